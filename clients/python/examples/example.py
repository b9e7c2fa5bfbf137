"""The README's example: python3 clients/python/examples/example.py [host:port]
(with PYTHONPATH=clients/python:build/clients/python). Run as written by the SDK's tests."""

import sys

import tandem

address = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1:50051"

with tandem.Client(address, timeout=60) as client:
    # Streaming: Prefill events, one Token per generated token, then the Result.
    for event in client.generate("Once upon a time", max_tokens=32, temperature=0.7, seed=1):
        if isinstance(event, tandem.Token):
            print(event.text, end="", flush=True)
        elif isinstance(event, tandem.Result):
            print(f"\n{event.usage.completion_tokens} tokens, finish: {event.finish_reason}, "
                  f"TTFT {event.time_to_first_token_seconds * 1e3:.1f} ms")

    # The whole text at once, with log-probabilities.
    result = client.complete("Once upon a time", max_tokens=8, logprobs=True, top_logprobs=2)
    print(result.text, [round(t.logprob, 3) for t in result.tokens])

    print(client.tokenize("Once upon a time", add_bos=True))   # [1, 403, 407, 261, 378]
    print(client.model_info().max_context)

    # A kept session: each turn continues the KV of the earlier ones; closed on leaving `with`.
    with client.session("chat-42") as session:
        session.complete("Once upon a time", max_tokens=16)
        print(session.complete(" The next day", max_tokens=16).text)

    # Cancellation: leaving the loop early stops the worker.
    for event in client.generate("Once upon a time", max_tokens=400):
        if isinstance(event, tandem.Token) and event.index == 2:
            break

    try:
        client.complete("Once upon a time", max_tokens=0)
    except tandem.InvalidArgument as e:
        print(e.code.name, e.message)   # INVALID_ARGUMENT max_tokens must be in 1..512, got 0
