#!/usr/bin/env python3
"""Check the exported GGUF against the PyTorch model it came from, with the stock llama.cpp build.

1. Tokeniser agreement: llama.cpp's tokenisation (scripts/llama_logits.cpp, the same call
   llama-perplexity makes) of eval/data/heldout.txt and eval/data/topic-shift.txt equals the HF
   tokenizer's.
2. Logits: llama.cpp's logits on the first --windows windows of n_ctx held-out tokens against the
   PyTorch model evaluated in fp32 with the matrices rounded to F16 as the GGUF stores them: with
   llama.cpp's default context (F16 KV cache, flash attention auto, as llama-perplexity runs) and
   with an F32 KV cache; and, when build/tinymoe/tinymoe-f32.gguf exists, the all-F32 export against
   the unrounded fp32 model (the exactness check of the export itself). Reports max abs error,
   max abs error / max |logit|, and the worst per-position relative L2 error.
3. Perplexity: llama-perplexity on heldout.txt (-c n_ctx, all chunks) against the PyTorch number
   computed the same way (second half of each chunk scored), from the eval stage of train_moe.py.

Writes the numbers to models/tinymoe-export-check.json.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import train_moe as tm  # noqa: E402

BIN = ROOT / "vendor/llama.cpp/build-cpu/bin"


def llama_tokenize(probe: Path, model: Path, text_file: Path) -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "ids.bin"
        subprocess.run([str(probe), "tokenize", str(model), str(text_file), str(out)], check=True,
                       capture_output=True)
        return np.fromfile(out, dtype=np.int32)


def llama_logits(probe: Path, model: Path, ids: np.ndarray, n_ctx: int, n_vocab: int,
                 f32_cache: bool = False) -> np.ndarray:
    with tempfile.TemporaryDirectory() as d:
        src, out = Path(d) / "ids.bin", Path(d) / "logits.bin"
        ids.astype(np.int32).tofile(src)
        cmd = [str(probe), "logits", str(model), str(src), str(n_ctx), str(out)] + (["f32"] if f32_cache else [])
        subprocess.run(cmd, check=True, capture_output=True)
        return np.fromfile(out, dtype=np.float32).reshape(-1, n_vocab)


def llama_perplexity(model: Path, text: Path, n_ctx: int, chunks: int | None = None,
                     threads: int = 2, tries: int = 3, extra: tuple[str, ...] = ()) -> float:
    """llama-perplexity's final estimate. Its log lines go through an asynchronous logger; on a loaded
    machine we saw a run exit 0 without its last chunk and its 'Final estimate' line, so the output
    goes to files and a run without that line is repeated (up to `tries` times)."""
    cmd = [str(BIN / "llama-perplexity"), "-m", str(model), "-f", str(text), "-c", str(n_ctx),
           "-b", str(n_ctx), "-t", str(threads)]
    if chunks is not None:
        cmd += ["--chunks", str(chunks)]
    cmd += list(extra)
    out = ""
    for _ in range(tries):
        with tempfile.TemporaryFile("w+") as fo, tempfile.TemporaryFile("w+") as fe:
            subprocess.run(cmd, stdout=fo, stderr=fe, check=True)
            fo.seek(0)
            fe.seek(0)
            out = fo.read() + fe.read()
        m = re.search(r"Final estimate: PPL = ([0-9.]+)", out)
        if m:
            return float(m.group(1))
    raise RuntimeError("no final estimate in llama-perplexity output:\n" + out[-2000:])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(ROOT / "models/tinymoe-f16.gguf"))
    ap.add_argument("--work", default=str(ROOT / "build/tinymoe"))
    ap.add_argument("--probe", default=str(ROOT / "build/llama_logits"))
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--out", default=str(ROOT / "models/tinymoe-export-check.json"))
    ap.add_argument("--quantized", default=None, help="a quantized copy of --model (e.g. models/studymoe-q8_0.gguf): "
                    "its llama-perplexity on heldout.txt is added beside the F16 file's")
    args = ap.parse_args()
    model, work, probe = Path(args.model), Path(args.work), Path(args.probe)

    import torch
    cfg, pt, ck = tm.load_trained(work / model.name)
    torch.set_num_threads(cfg.threads)
    tok = tm.load_tokenizer(work)
    res: dict = {"model": model.name, "n_ctx": cfg.n_ctx}

    # 1. tokeniser agreement
    for name in ("heldout.txt", "topic-shift.txt"):
        path = ROOT / "eval/data" / name
        hf = np.asarray(tok.encode(path.read_text(encoding="utf-8"), add_special_tokens=False).ids)
        ll = llama_tokenize(probe, model, path)
        same = len(hf) == len(ll) and bool((hf == ll).all())
        first_diff = None
        if not same:
            n = min(len(hf), len(ll))
            d = np.nonzero(hf[:n] != ll[:n])[0]
            first_diff = int(d[0]) if len(d) else n
        res[f"tokenizer_{name}"] = {"hf_tokens": int(len(hf)), "llama_tokens": int(len(ll)),
                                    "identical": same, "first_difference": first_diff}
        print(name, res[f"tokenizer_{name}"])

    # 2. logits on the first windows of held-out text
    ids = np.asarray(tok.encode((ROOT / "eval/data/heldout.txt").read_text(encoding="utf-8"),
                                add_special_tokens=False).ids, dtype=np.int64)
    ids = ids[: args.windows * cfg.n_ctx]
    m16 = tm.f16_rounded(cfg, pt)
    f32_model = work / model.name.replace("-f16", "-f32")
    cases = [("f16_gguf_default_context", model, m16, False),   # F16 KV cache, flash attention auto
             ("f16_gguf_f32_kv_cache", model, m16, True)]
    if f32_model.exists():
        cases.append(("f32_gguf_f32_kv_cache", f32_model, pt, True))
    res["logits"] = {}
    for label, gg, ref_model, f32_cache in cases:
        ll = llama_logits(probe, gg, ids, cfg.n_ctx, cfg.vocab_size, f32_cache=f32_cache)
        with torch.no_grad():
            ref = torch.cat([ref_model(torch.from_numpy(ids[w * cfg.n_ctx:(w + 1) * cfg.n_ctx])[None])[0][0]
                             for w in range(args.windows)]).double().numpy()
        diff = np.abs(ll.astype(np.float64) - ref)
        row_rel = np.linalg.norm(ll - ref, axis=1) / np.linalg.norm(ref, axis=1)
        res["logits"][label] = {
            "gguf": gg.name,
            "positions": int(ref.shape[0]),
            "max_abs_err": float(diff.max()),
            "mean_abs_err": float(diff.mean()),
            "max_abs_logit": float(np.abs(ref).max()),
            "max_abs_err_over_max_abs_logit": float(diff.max() / np.abs(ref).max()),
            "max_row_rel_l2_err": float(row_rel.max()),
            "argmax_agreement": float((ll.argmax(1) == ref.argmax(1)).mean()),
        }
        print(label, json.dumps(res["logits"][label], indent=1))

    # 3. perplexity on heldout.txt, all chunks
    ev = json.loads((work / model.name).with_suffix(".eval.json").read_text())
    ppl_ll = llama_perplexity(model, ROOT / "eval/data/heldout.txt", cfg.n_ctx)
    ppl_prefix = llama_perplexity(model, ROOT / "eval/data/heldout.txt", cfg.n_ctx, chunks=16)
    res["perplexity"] = {
        "llama_perplexity": ppl_ll,
        "pytorch": ev["ppl_pytorch_f16_weights"],
        "rel_diff": abs(ppl_ll - ev["ppl_pytorch_f16_weights"]) / ev["ppl_pytorch_f16_weights"],
        "llama_perplexity_first16chunks": ppl_prefix,
        "pytorch_first16chunks": ev["ppl_pytorch_f16_weights_first16chunks"],
        "rel_diff_first16chunks": abs(ppl_prefix - ev["ppl_pytorch_f16_weights_first16chunks"])
        / ev["ppl_pytorch_f16_weights_first16chunks"],
    }
    if args.quantized:
        q = Path(args.quantized)
        # --no-repack: this VM advertises AVX-512/AMX, and stock llama.cpp's repack kernels die with SIGILL on Q8_0
        ppl_q = llama_perplexity(q, ROOT / "eval/data/heldout.txt", cfg.n_ctx, extra=("--no-repack",))
        qtype = q.stem.rsplit("-", 1)[-1]
        res["perplexity"][f"llama_perplexity_{qtype}"] = ppl_q
        res["perplexity"]["quantized_gguf"] = q.name
    print(json.dumps(res["perplexity"], indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
