"""The llama.cpp peer of the GGUF benchmark; runs inside the llama.cpp venv, not pagedllm's.

``benchmarks/gguf.py --llama-cpp`` starts this file with the python of the venv made by
benchmarks/setup_llama_cpp.sh (llama-cpp-python built from source for this CPU), on the same
GGUF file and thread count as pagedllm. It drives llama.cpp through its C API (the ctypes
bindings), the way llama.cpp's own ``batched`` example does, so no Python wrapper logic sits in
the timed loops: one ``llama_decode`` per step, greedy picks by numpy argmax over the logits.

The --serve protocol (benchmarks/common.py ServedPeer): it prints one JSON line
``{"ready": true, "llama_cpp_version", "system_info", "load_s"}``, then answers every JSON line on
stdin with one JSON line:
  {"kind": "decode", "prompt": [ids], "max_tokens": n}
      -> {"prefill_s", "decode_s", "token_ids"}: one request; prefill_s is the prompt's one
         llama_decode (its first token sampled), decode_s the n - 1 single-token steps after it.
  {"kind": "batch", "prompts": [[ids]...], "max_tokens": [n...]}
      -> {"elapsed_s", "num_tokens", "token_ids"}: every request at once, continuous batching
         in one llama_decode per step: the prompts first (split at n_batch tokens), then one token
         per unfinished request per step (llama.cpp's best batched mode for many requests).
Greedy, EOS ignored (the lengths are the workload's). The KV memory is cleared before each job.

``--quantize IN OUT TYPE`` instead quantizes the GGUF file IN to OUT with llama.cpp's own
quantizer (``llama_model_quantize``, what llama-quantize runs): TYPE is Q8_0, Q4_0 or Q4_K_M.

Only the standard library, numpy and llama_cpp are imported (pagedllm is not installed there).

    .venv-llama-cpp/bin/python benchmarks/llama_cpp_peer.py --model F.gguf --threads 2 --serve
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time


class Peer:
    def __init__(self, model_path: str, threads: int, n_ctx: int, n_seq_max: int,
                 n_batch: int) -> None:
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        start = time.perf_counter()
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(model_path.encode(), mparams)
        if not self.model:
            raise SystemExit(f"llama.cpp could not load {model_path}")
        cparams = lc.llama_context_default_params()
        cparams.n_ctx, cparams.n_batch, cparams.n_ubatch = n_ctx, n_batch, n_batch
        cparams.n_seq_max = n_seq_max
        cparams.n_threads = cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("llama.cpp could not create a context")
        self.n_batch = n_batch
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.batch = lc.llama_batch_init(n_batch, 0, 1)
        self.load_s = time.perf_counter() - start

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(self.ctx), True)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of ``(token, position, sequence, wants_logits)`` entries."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0], b.logits[i] = seq, logits
        b.n_tokens = len(entries)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise SystemExit(f"llama_decode failed ({rc}): the context is too small?")

    def _argmax(self, index: int) -> int:
        ptr = self.lc.llama_get_logits_ith(self.ctx, index)
        logits = self.np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)),
                                            shape=(self.n_vocab,))
        return int(logits.argmax())

    def run_decode(self, prompt: list[int], max_tokens: int) -> dict:
        self._clear()
        start = time.perf_counter()
        out = []
        for begin in range(0, len(prompt), self.n_batch):  # a prompt longer than a batch: chunks
            part = prompt[begin:begin + self.n_batch]
            self._decode([(t, begin + j, 0, begin + j == len(prompt) - 1) for j, t in enumerate(part)])
        out.append(self._argmax(len(prompt) - 1 - (len(prompt) - 1) // self.n_batch * self.n_batch))
        prefill_s = time.perf_counter() - start
        start = time.perf_counter()
        pos = len(prompt)
        while len(out) < max_tokens:
            self._decode([(out[-1], pos, 0, True)])
            out.append(self._argmax(0))
            pos += 1
        return {"prefill_s": prefill_s, "decode_s": time.perf_counter() - start, "token_ids": out}

    def run_batch(self, prompts: list[list[int]], max_tokens: list[int]) -> dict:
        self._clear()
        start = time.perf_counter()
        outs: list[list[int]] = [[] for _ in prompts]
        # The prompts, packed into batches of n_batch tokens; the last token of each wants logits.
        pending = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
        for begin in range(0, len(pending), self.n_batch):
            part = pending[begin:begin + self.n_batch]
            self._decode(part)
            for i, (_, _, s, last) in enumerate(part):
                if last:
                    outs[s].append(self._argmax(i))
        while True:
            live = [s for s in range(len(prompts)) if len(outs[s]) < max_tokens[s]]
            if not live:
                break
            self._decode([(outs[s][-1], len(prompts[s]) + len(outs[s]) - 1, s, True) for s in live])
            for i, s in enumerate(live):
                outs[s].append(self._argmax(i))
        return {"elapsed_s": time.perf_counter() - start,
                "num_tokens": sum(len(o) for o in outs), "token_ids": outs}


FTYPES = {"Q8_0": 7, "Q4_0": 2, "Q4_K_M": 15}  # llama.cpp's llama_ftype values


def quantize(src: str, dst: str, type_name: str, threads: int) -> int:
    import llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype, params.nthread = FTYPES[type_name], threads
    return lc.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantize", nargs=3, metavar=("IN", "OUT", "TYPE"))
    p.add_argument("--model", help="the GGUF file")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--n-ctx", type=int, default=16384, help="KV cells over all sequences")
    p.add_argument("--n-seq-max", type=int, default=64)
    p.add_argument("--n-batch", type=int, default=512)
    p.add_argument("--serve", action="store_true")
    args = p.parse_args(argv)
    if args.quantize:
        return quantize(*args.quantize, args.threads)
    if not (args.model and args.serve):
        p.error("give --model FILE --serve, or --quantize IN OUT TYPE")
    peer = Peer(args.model, args.threads, args.n_ctx, args.n_seq_max, args.n_batch)
    import llama_cpp

    ready = {"ready": True, "llama_cpp_version": llama_cpp.__version__, "load_s": peer.load_s,
             "system_info": llama_cpp.llama_print_system_info().decode()}
    sys.stdout.write(json.dumps(ready) + "\n")
    sys.stdout.flush()
    for line in sys.stdin:
        if not line.strip():
            continue
        job = json.loads(line)
        if job["kind"] == "decode":
            result = peer.run_decode(job["prompt"], job["max_tokens"])
        else:
            result = peer.run_batch(job["prompts"], job["max_tokens"])
        sys.stdout.write(json.dumps(result) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
