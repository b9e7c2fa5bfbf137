#!/usr/bin/env python3
"""The Python SDK (clients/python, package `tandem`) against a real tandem-gpu-worker.

One worker (cpu backend, stories260k, gpu mode: exact greedy) serves every case but
cancellation (a second worker, gutenberg-14m, whose context holds a long request): greedy
generation equals the model's golden continuation (../shared/models/stories260k/golden.json),
tokenize, a two-turn session equal to the one-shot generation over the same ids, close then
NotFound, mode "exact" (the same greedy text, with its split) and GetCapacity (a context that
fits, one that does not, the largest context at its edge), refusals as typed errors naming the
field, deadlines, an unreachable worker, and cancellation by breaking out of the loop, and the
README example run as written.

Run by ctest (tests/clients/CMakeLists.txt) with PYTHONPATH=clients/python:build/clients/python,
TANDEM_GPU_WORKER_BIN and TANDEM_SHARED_DIR. Exits 77 (ctest: skipped) with a message when
python3-grpcio / python3-protobuf, the generated stubs or the models are absent.
"""

import json
import os
import socket
import subprocess
import sys
import unittest

SKIP_EXIT_CODE = 77
HERE = os.path.dirname(os.path.abspath(__file__))


def skip(reason: str) -> None:
    print(f"SKIPPED: {reason}")
    sys.exit(SKIP_EXIT_CODE)


try:
    import grpc  # noqa: F401
    import google.protobuf  # noqa: F401
except ImportError as e:
    skip(f"{sys.executable} lacks gRPC ({e}): apt-get install python3-grpcio python3-protobuf")
try:
    import tandem
except ImportError as e:
    # Only stubs that were never generated (no grpc_python_plugin at build time) skip; any other
    # import failure is a bug of the package.
    if any(os.path.exists(os.path.join(p, "tandem", "v1", "generation_pb2.py")) for p in sys.path):
        raise
    skip(f"the tandem package cannot be imported: {e}")

sys.path.insert(0, HERE)
from worker_process import WorkerProcess  # noqa: E402

SHARED_DIR = os.environ.get("TANDEM_SHARED_DIR") or os.path.join(HERE, "../../../../shared")
MODEL_DIR = os.path.join(SHARED_DIR, "models", "stories260k")
WORKER_BIN = os.environ.get("TANDEM_GPU_WORKER_BIN", "")

if not os.path.exists(os.path.join(MODEL_DIR, "golden.json")):
    skip(f"no stories260k model at {MODEL_DIR} (set TANDEM_SHARED_DIR)")

with open(os.path.join(MODEL_DIR, "golden.json")) as f:
    GOLDEN = json.load(f)
PROMPT = GOLDEN["prompt_text_equivalent"]                  # "Once upon a time"
PROMPT_IDS = GOLDEN["prompt_text_equivalent_ids"]          # its ids, BOS first
CONTINUATION_IDS = GOLDEN["greedy_ids"][len(PROMPT_IDS):]  # 56 greedy tokens
CONTINUATION_TEXT = GOLDEN["greedy_text"][len(PROMPT):]

worker: WorkerProcess
client: "tandem.Client"


def setUpModule() -> None:
    global worker, client
    if not os.access(WORKER_BIN, os.X_OK):
        raise RuntimeError(f"TANDEM_GPU_WORKER_BIN={WORKER_BIN!r} is not an executable "
                           "(build the tandem-gpu-worker target)")
    worker = WorkerProcess(WORKER_BIN, MODEL_DIR)
    worker.start()
    client = tandem.Client(worker.address, timeout=60)


def tearDownModule() -> None:
    client.close()
    worker.stop()


class GenerateTest(unittest.TestCase):
    def test_greedy_stream_is_the_golden_continuation(self) -> None:
        events = list(client.generate(PROMPT, max_tokens=len(CONTINUATION_IDS)))
        prefills = [e for e in events if isinstance(e, tandem.Prefill)]
        tokens = [e for e in events if isinstance(e, tandem.Token)]
        self.assertTrue(prefills)
        self.assertEqual((prefills[-1].processed, prefills[-1].total), (5, 5))
        self.assertEqual([t.id for t in tokens], CONTINUATION_IDS)
        self.assertEqual([t.index for t in tokens], list(range(len(CONTINUATION_IDS))))
        self.assertEqual("".join(t.text for t in tokens), CONTINUATION_TEXT)
        self.assertTrue(all(t.logprob is None and t.top_logprobs == () for t in tokens))

        result = events[-1]
        self.assertIsInstance(result, tandem.Result)
        self.assertEqual(result.type, "final")
        self.assertEqual(result.text, CONTINUATION_TEXT)
        self.assertEqual(list(result.token_ids), CONTINUATION_IDS)
        self.assertEqual(result.usage, tandem.Usage(5, 56, 61))
        self.assertEqual(result.finish_reason, "length")
        self.assertEqual(result.mode, "gpu")
        self.assertEqual(result.session_id, "")
        self.assertEqual(result.device_kv_entries, 60)   # prompt + tokens fed back (not the last)
        self.assertFalse(result.degraded)
        self.assertGreater(result.time_to_first_token_seconds, 0)
        self.assertGreaterEqual(result.total_seconds, result.time_to_first_token_seconds)
        # A proto field without an attribute of its own reads through to the message.
        self.assertEqual([t.token_id for t in tokens], CONTINUATION_IDS)
        self.assertEqual(result.raw.usage.total_tokens, 61)

    def test_complete_from_prompt_ids(self) -> None:
        result = client.complete(PROMPT_IDS, max_tokens=len(CONTINUATION_IDS))
        self.assertEqual(result.text, CONTINUATION_TEXT)
        self.assertEqual(result.usage.prompt_tokens, len(PROMPT_IDS))

    def test_stop_string_ends_the_text_before_it(self) -> None:
        result = client.complete(PROMPT, max_tokens=56, stop=["Lily"])
        self.assertEqual(result.finish_reason, "stop")
        self.assertEqual(result.text, CONTINUATION_TEXT[:CONTINUATION_TEXT.index("Lily")])

    def test_logprobs_of_greedy_tokens(self) -> None:
        result = client.complete(PROMPT, max_tokens=8, logprobs=True, top_logprobs=3)
        self.assertEqual(list(result.token_ids), CONTINUATION_IDS[:8])
        for token in result.tokens:
            self.assertIsNotNone(token.logprob)
            self.assertLessEqual(token.logprob, 0.0)
            self.assertEqual(len(token.top_logprobs), 3)
            # Greedy: the sampled token is the likeliest one.
            self.assertEqual(token.top_logprobs[0].id, token.id)
            self.assertAlmostEqual(token.top_logprobs[0].logprob, token.logprob, places=5)
            self.assertEqual([t.logprob for t in token.top_logprobs],
                             sorted((t.logprob for t in token.top_logprobs), reverse=True))
            self.assertEqual(token.top_logprobs[0].text.encode(), token.top_logprobs[0].bytes)


class TokenizerTest(unittest.TestCase):
    def test_tokenize_and_detokenize(self) -> None:
        self.assertEqual(client.tokenize(PROMPT, add_bos=True), PROMPT_IDS)
        self.assertEqual(len(client.tokenize(PROMPT)), len(PROMPT_IDS) - 1)
        self.assertEqual(client.detokenize(PROMPT_IDS[1:]), PROMPT)

    def test_model_info(self) -> None:
        info = client.model_info()
        self.assertEqual(info.model_type, "llama")
        self.assertEqual(info.backend, "cpu")
        self.assertEqual((info.vocab_size, info.max_context, info.num_layers), (512, 512, 5))
        self.assertEqual(list(info.eos_token_ids), [2])   # config.json and generation_config.json


class SessionTest(unittest.TestCase):
    def test_two_turns_continue_the_kv(self) -> None:
        with client.session("py-two-turns") as session:
            first = session.complete(PROMPT, max_tokens=8)
            second = session.complete(" The end", max_tokens=8)
        self.assertEqual(first.session_id, "py-two-turns")
        self.assertEqual(list(first.token_ids), CONTINUATION_IDS[:8])
        second_prompt = client.tokenize(" The end")   # a continued turn gets no BOS
        self.assertEqual(second.usage.prompt_tokens, len(second_prompt))
        # The kept KV: the second turn continues exactly as one request over all the ids would.
        one_shot = client.complete(PROMPT_IDS + list(first.token_ids) + second_prompt,
                                   max_tokens=8)
        self.assertEqual(second.token_ids, one_shot.token_ids)
        self.assertEqual(second.device_kv_entries,
                         first.usage.total_tokens + second.usage.total_tokens - 1)
        # The `with` block closed it.
        with self.assertRaises(tandem.NotFound):
            client.close_session("py-two-turns")

    def test_close_then_not_found(self) -> None:
        session = client.session("py-close")
        session.complete(PROMPT, max_tokens=2)
        session.close()
        with self.assertRaises(tandem.NotFound) as caught:
            session.close()
        self.assertEqual(caught.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertIn("py-close", caught.exception.message)
        self.assertIsInstance(caught.exception, tandem.TandemError)


class ErrorTest(unittest.TestCase):
    def test_invalid_requests_name_the_field(self) -> None:
        cases = [({"max_tokens": 0}, "max_tokens"),
                 ({"max_tokens": 4, "temperature": -1.0}, "temperature"),
                 ({"max_tokens": 4, "top_logprobs": 2}, "logprobs")]
        for options, field_name in cases:
            with self.subTest(options=options):
                with self.assertRaises(tandem.InvalidArgument) as caught:
                    client.complete(PROMPT, **options)
                self.assertEqual(caught.exception.code, grpc.StatusCode.INVALID_ARGUMENT)
                self.assertIn(field_name, caught.exception.message)
        with self.assertRaises(tandem.InvalidArgument) as caught:
            client.complete(PROMPT, max_tokens=4, session_id="not a valid id!")
        self.assertIn("session_id", caught.exception.message)
        with self.assertRaises(tandem.InvalidArgument) as caught:
            client.detokenize([9999])
        self.assertIn("token_ids", caught.exception.message)
        # The worker keeps serving.
        self.assertEqual(client.complete(PROMPT, max_tokens=3).token_ids,
                         tuple(CONTINUATION_IDS[:3]))

    def test_bad_arguments_are_refused_before_sending(self) -> None:
        with self.assertRaisesRegex(TypeError, "max_token"):
            client.generate(PROMPT, max_token=4)
        with self.assertRaisesRegex(TypeError, "prompt"):
            client.generate(42, max_tokens=4)
        with self.assertRaisesRegex(TypeError, "temperature"):
            client.generate(PROMPT, max_tokens=4, temperature="hot")

    def test_deadline_exceeded(self) -> None:
        with self.assertRaises(tandem.DeadlineExceeded):
            client.complete(PROMPT, max_tokens=4, timeout=1e-6)

    def test_unreachable_worker_is_unavailable(self) -> None:
        with socket.socket() as s:   # a port nobody listens on
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        with tandem.Client(f"127.0.0.1:{port}", timeout=5) as nowhere:
            with self.assertRaises(tandem.Unavailable):
                nowhere.tokenize(PROMPT)


class CancelTest(unittest.TestCase):
    # On gutenberg-14m (its own worker; skipped without the model): its 8192-token context lets
    # a request ask for 8000 tokens, all the context but the prompt, which the worker would fill
    # if it did not stop after the current token once the call is cancelled. Hybrid attention
    # (window 16, the rest on the worker's embedded CPU node, exact with maw and beta 0) costs
    # milliseconds a token there, so the whole 8000 would take far longer (tens of seconds) than
    # the cancel takes to arrive, even on a loaded CI machine. (stories260k's 512 positions left
    # ~0.5 s of generation to race the cancel.)
    LONG = 8000
    HYBRID = {"mode": "hybrid", "window": 16, "sink": 4, "selection": "maw", "beta": 0.0}
    LONG_PROMPT = "It was a dark and stormy night"
    LONG_MODEL_DIR = os.path.join(SHARED_DIR, "models", "gutenberg-14m")

    @classmethod
    def setUpClass(cls) -> None:
        if not os.path.exists(os.path.join(cls.LONG_MODEL_DIR, "config.json")):
            raise unittest.SkipTest(f"no gutenberg-14m model at {cls.LONG_MODEL_DIR}")
        cls.worker = WorkerProcess(WORKER_BIN, cls.LONG_MODEL_DIR)
        cls.worker.start()
        cls.client = tandem.Client(cls.worker.address, timeout=60)
        # The greedy tokens the cancelled calls must start with, from calls that are not.
        cls.hybrid_ids = list(cls.client.complete(cls.LONG_PROMPT, max_tokens=3,
                                                  **cls.HYBRID).token_ids)
        cls.gpu_first = cls.client.complete(cls.LONG_PROMPT, max_tokens=1)
        cls.prompt_tokens = cls.gpu_first.usage.prompt_tokens

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.worker.stop()

    def test_breaking_the_loop_cancels_the_call(self) -> None:
        session = self.client.session("py-cancel")
        seen = []
        for event in session.generate(self.LONG_PROMPT, max_tokens=self.LONG, ignore_eos=True,
                                      **self.HYBRID):
            if isinstance(event, tandem.Token):
                seen.append(event.id)
                if len(seen) == 3:
                    break   # the stream is dropped here: its call is cancelled
        self.assertEqual(seen, self.hybrid_ids)
        # The next turn waits for the cancelled one to end, then continues the session from the
        # tokens generated up to the cancel: far fewer than LONG.
        after = session.complete(" The end", max_tokens=1)
        self.assertEqual(after.mode, "hybrid")
        positions = after.device_kv_entries + after.cpu_kv_entries
        generated = positions - self.prompt_tokens - after.usage.total_tokens + 1
        self.assertGreaterEqual(generated, 3)
        self.assertLess(generated, self.LONG)
        session.close()

    def test_cancel_then_next_raises_cancelled(self) -> None:
        stream = self.client.generate(self.LONG_PROMPT, max_tokens=self.LONG, ignore_eos=True)
        first = next(e for e in stream if isinstance(e, tandem.Token))
        self.assertEqual(first.id, self.gpu_first.token_ids[0])
        stream.cancel()
        self.assertTrue(stream.cancelled)
        with self.assertRaises(tandem.Cancelled):
            for _ in stream:
                pass
        self.assertIsNone(stream.result)


class ExactModeTest(unittest.TestCase):
    def test_exact_mode_is_the_golden_continuation_with_its_split(self) -> None:
        # A 32-token window: of the 60 positions most leave the device and are attended exactly
        # from host pages (a toy model's planned split is all-fetch).
        result = client.complete(PROMPT, max_tokens=len(CONTINUATION_IDS), mode="exact",
                                 window=32, sink=4)
        self.assertEqual(result.mode, "exact")
        self.assertEqual(result.text, CONTINUATION_TEXT)
        split = result.exact_split
        self.assertIsInstance(split, tandem.ExactSplit)
        self.assertAlmostEqual(split.fetch_share + split.node_share + split.recompute_share, 1.0,
                               places=6)
        self.assertGreater(split.host_entries + split.node_entries, 0)
        self.assertLess(result.device_kv_entries, 60)
        self.assertGreater(split.modelled_step_seconds, 0)
        self.assertTrue(split.recompute_reason)
        self.assertEqual(split.host_entries, result.raw.exact_split.host_entries)

    def test_other_modes_carry_no_split(self) -> None:
        result = client.complete(PROMPT, max_tokens=4)
        self.assertEqual(result.mode, "gpu")
        self.assertIsNone(result.exact_split)

    def test_exact_with_beta_is_refused(self) -> None:
        with self.assertRaises(tandem.InvalidArgument) as cm:
            client.complete(PROMPT, max_tokens=4, mode="exact", beta=0)
        self.assertIn("mode exact", cm.exception.message)


class CapacityTest(unittest.TestCase):
    # Hybrid with a 64-token window: 256 sequences of 512 positions need ~150 MiB of node KV,
    # more than the worker's 64 MiB embedded pool.
    HYBRID = dict(mode="hybrid", window=64, sink=4, batch=256)

    def test_a_small_context_fits(self) -> None:
        plan = client.capacity(256)
        self.assertIsInstance(plan, tandem.Capacity)
        self.assertEqual((plan.context, plan.prompt, plan.batch, plan.mode), (256, 256, 1, "gpu"))
        self.assertTrue(plan.fits)
        self.assertTrue(plan.device.fits and plan.host.fits and plan.nodes.fits)
        self.assertEqual(plan.why, "")
        self.assertEqual(plan.largest_context, 512)   # stories260k's max_context
        self.assertEqual(plan.device.item("weights").bytes, 1040128)   # 260K f32 parameters
        self.assertEqual(sum(i.bytes for i in plan.device.items), plan.device.total_bytes)
        self.assertLessEqual(plan.device.total_bytes, plan.device.capacity_bytes)
        self.assertIn("largest context that fits", plan.text)

    def test_a_large_batch_does_not_fit_and_the_largest_context_does(self) -> None:
        plan = client.capacity(512, **self.HYBRID)
        self.assertFalse(plan.fits)
        self.assertFalse(plan.nodes.fits)
        self.assertTrue(plan.device.fits)
        self.assertIn("in-process", plan.nodes.why)
        self.assertEqual(plan.why, plan.nodes.why)
        self.assertGreater(plan.nodes.total_bytes, plan.nodes.capacity_bytes)
        self.assertEqual(plan.nodes.capacity_bytes, 64 << 20)
        self.assertEqual(len(plan.node_bytes), len(plan.node_addresses))
        self.assertGreater(plan.largest_context, 68)   # more than sink + window
        self.assertLess(plan.largest_context, 512)
        # The largest context fits, one token more does not.
        self.assertTrue(client.capacity(plan.largest_context, **self.HYBRID).fits)
        self.assertFalse(client.capacity(plan.largest_context + 1, **self.HYBRID).fits)

    def test_bad_arguments(self) -> None:
        with self.assertRaises(tandem.InvalidArgument) as cm:
            client.capacity(513)
        self.assertIn("context must be in 1..512", cm.exception.message)
        with self.assertRaises(tandem.InvalidArgument):
            client.capacity(64, mode="fast")
        with self.assertRaises(TypeError):
            client.capacity(64, window="wide")


class ExampleTest(unittest.TestCase):
    def test_the_readme_example_runs_as_written(self) -> None:
        example = os.path.join(HERE, "../../../clients/python/examples/example.py")
        r = subprocess.run([sys.executable, example, worker.address], capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(r.returncode, 0, r.stderr)
        lines = r.stdout.splitlines()
        self.assertRegex(lines[1], r"^32 tokens, finish: length, TTFT ")
        self.assertIn("[1, 403, 407, 261, 378]", lines)
        self.assertIn("512", lines)
        self.assertEqual(lines[-1], "INVALID_ARGUMENT max_tokens must be in 1..512, got 0")


if __name__ == "__main__":
    unittest.main(verbosity=2)
