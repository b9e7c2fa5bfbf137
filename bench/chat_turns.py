#!/usr/bin/env python3
"""A multi-turn chat over one document through tandem-gateway, as OpenAI clients hold it (issue 25).

Two paths, each over its own document (so neither hits the other's prefix cache):
  chat       POST /v1/chat/completions with the whole history resent every turn
  responses  POST /v1/responses with only the new turn and previous_response_id
Every answer is streamed; TTFT is the time from sending the request to its first text delta.
Prints one line per turn: TTFT, its share of turn 1's, prompt tokens and cached tokens (usage).

  chat_turns.py --port 8000 --doc A.txt --doc B.txt [--doc_chars 110000] [--turns 3]
                [--max_tokens 32] [--paths chat,responses]
"""
import argparse
import http.client
import json
import sys
import time

QUESTIONS = ["Who is speaking in this text?", "What happens next?", "Where does it take place?",
             "Who else appears?", "How does it end?"]


def stream(port, path, body):
    """(ttft_s, text, usage, response_id) of one streamed answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=3600)
    start = time.time()
    conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
    res = conn.getresponse()
    if res.status != 200:
        sys.exit("%s: HTTP %d %s" % (path, res.status, res.read()[:500]))
    ttft, text, usage, response_id = None, "", None, None
    for raw in res:
        line = raw.decode("utf-8", "replace").strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if path == "/v1/chat/completions":
            usage = event.get("usage") or usage
            for choice in event.get("choices", []):
                delta = choice.get("delta", {}).get("content") or ""
                if delta and ttft is None:
                    ttft = time.time() - start
                text += delta
        elif event["type"] == "response.output_text.delta":
            if ttft is None:
                ttft = time.time() - start
            text += event["delta"]
        elif event["type"] in ("response.completed", "response.incomplete"):
            usage, response_id = event["response"]["usage"], event["response"]["id"]
        elif event["type"] == "error":
            sys.exit("%s: %s" % (path, event["message"]))
    if ttft is None:
        sys.exit("%s: the answer had no text to time (a model whose tokens have none?)" % path)
    return ttft, text, usage, response_id


def chat(port, doc, turns, max_tokens):
    messages, rows = [], []
    for i in range(turns):
        messages.append({"role": "user",
                         "content": (doc + "\n\n" if i == 0 else "") + QUESTIONS[i]})
        ttft, text, usage, _ = stream(port, "/v1/chat/completions", {
            "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}})
        messages.append({"role": "assistant", "content": text})
        rows.append((ttft, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]))
    return rows


def responses(port, doc, turns, max_tokens):
    previous, rows = None, []
    for i in range(turns):
        body = {"input": (doc + "\n\n" if i == 0 else "") + QUESTIONS[i],
                "max_output_tokens": max_tokens, "temperature": 0, "stream": True}
        if previous:
            body["previous_response_id"] = previous
        ttft, _, usage, previous = stream(port, "/v1/responses", body)
        rows.append((ttft, usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"]))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--doc", action="append", required=True,
                        help="document text file, one per path (the last one is reused)")
    parser.add_argument("--doc_chars", type=int, default=110000)
    parser.add_argument("--turns", type=int, default=3, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--max_tokens", type=int, default=32)
    parser.add_argument("--paths", default="chat,responses")
    args = parser.parse_args()
    runs = {"chat": ("chat completions, history resent", chat),
            "responses": ("Responses API, previous_response_id", responses)}
    for n, path in enumerate(args.paths.split(",")):
        title, run = runs[path]
        with open(args.doc[min(n, len(args.doc) - 1)], encoding="utf-8", errors="replace") as f:
            doc = f.read()[5000:5000 + args.doc_chars]   # past the Gutenberg header
        rows = run(args.port, doc, args.turns, args.max_tokens)
        print(title)
        for i, (ttft, prompt, cached) in enumerate(rows):
            print("  turn %d: TTFT %.3f s (%.1f%% of turn 1), prompt %d tokens, cached %d"
                  % (i + 1, ttft, 100 * ttft / rows[0][0], prompt, cached), flush=True)


if __name__ == "__main__":
    main()
