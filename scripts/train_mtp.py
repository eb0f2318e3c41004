#!/usr/bin/env python3
"""Train a multi-token-prediction head (`mtp.*`, one full-attention layer) for the bundled
target, with the target frozen, and ship it inside the target's checkpoint.

The head is vLLM's qwen3_5_mtp (python/sapwood/reference/mtp.py): for the target's final hidden
state h_i and the next token t_{i+1}, x = fc([pre_fc_norm_embedding(embed(t_{i+1})),
pre_fc_norm_hidden(h_i)]), one decoder layer at position i, mtp.norm, the target's tied LM head.
It learns the target's own distribution at position i+1 (the one it drafts for): the loss is
KL(target || head) over the whole vocabulary, at no cost beyond the target's frozen forward.
Only depth 1 is trained, as the released heads are; deeper draft rows feed the head's own output.

Stages (--out holds the work files):

    corpus   the stdlib file list and held-out split of train_default.py (same rule)
    train    train the head (AdamW, warmup-stable-decay by wall time), fp32   -> mtp.pt, log.txt
    export   add the head's tensors (bf16) to the bundled target's model.safetensors, leaving
             every existing tensor's bytes as they were; mtp_num_hidden_layers=1 in its
             config.json; the recipe in RECIPE.json["mtp"]
    all      the three in order

    nohup nice -n 10 python3 scripts/train_mtp.py all --out /work/train_mtp > /work/train_mtp.log 2>&1 &
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_default as td  # noqa: E402  (the training model, corpus and helpers)

TARGET_DIR = td.EXPORT_DIR / "target"
SEED = td.SEED + 36
TRAIN = {"seq_len": 128, "batch": 8, "lr": 2e-3, "min_lr_frac": 0.1, "warmup": 10,
         "weight_decay": 0.0, "betas": [0.9, 0.95], "clip": 1.0, "max_minutes": 20.0,
         "decay_minutes": 5.0, "eval_windows": 16, "log_every": 5, "init_from_layer": 7}


class MTPHead(nn.Module):
    """The head with the checkpoint's parameter names under `mtp.`."""

    def __init__(self, c):
        super().__init__()
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        self.fc = nn.Linear(2 * H, H, bias=False)
        self.pre_fc_norm_embedding = td.RMSNorm(H, eps)
        self.pre_fc_norm_hidden = td.RMSNorm(H, eps)
        self.layers = nn.ModuleList([td.DecoderLayer(c, td.FULL)])
        self.norm = td.RMSNorm(H, eps)

    def forward(self, emb, hidden, cos, sin):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], -1))
        return self.norm(self.layers[0](x, cos, sin))


def load_target():
    from sapwood.safetensors_io import load_checkpoint_weights

    config = json.loads((TARGET_DIR / "config.json").read_text())
    model = td.HybridLM(config)
    w = {n: torch.from_numpy(np.asarray(x, np.float32)) for n, x in
         load_checkpoint_weights(TARGET_DIR).items() if not n.startswith("mtp.")}
    missing, unexpected = model.load_state_dict(w, strict=False)
    assert not unexpected and all(m.startswith("lm_head") for m in missing), (missing, unexpected)
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval(), config


def init_head(target, config):
    head = MTPHead(config)
    layer = target.model.layers[TRAIN["init_from_layer"]]
    assert layer.kind == td.FULL
    head.layers[0].load_state_dict(layer.state_dict())  # a trained attention layer to start from
    H = config["hidden_size"]
    with torch.no_grad():  # x starts as the normed hidden state plus a little of the embedding
        head.fc.weight.normal_(0.0, 0.02)
        head.fc.weight[:, H:] += torch.eye(H)
    return head


def tokens(out: Path, split: str) -> np.ndarray:
    f = out / f"tokens_{split}.npy"
    if not f.exists():
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(TARGET_DIR / "tokenizer.json"))
        _, texts = td.read_corpus(out)
        ids = []
        for enc in tok.encode_batch(texts[split], add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(tok.token_to_id(td.EOS))
        np.save(f, np.asarray(ids, np.uint16))
    return np.load(f)


def step_loss(target, head, w):
    """KL(target || head) of the target's distribution at i+1 against the head's row i, and the
    head's top-1 agreement with the target's argmax there."""
    ids = w[:, :-1]
    T = ids.shape[1]
    with torch.no_grad():
        h = target.hidden(ids)                                  # [B, T, H], after model.norm
        E = target.model.embed_tokens.weight
        logp_t = F.log_softmax(h[:, 1:] @ E.T, -1)               # the target at i+1
        emb = target.model.embed_tokens(ids[:, 1:])              # t_{i+1}
        cos, sin = target.rope(0, T - 1, h.dtype)                # row i at position i
    o = head(emb, h[:, :-1], cos, sin)
    logp_h = F.log_softmax(o @ E.T, -1)
    kl = (logp_t.exp() * (logp_t - logp_h)).sum(-1).mean()
    agree = (logp_h.argmax(-1) == logp_t.argmax(-1)).float().mean()
    return kl, agree


def stage_train(out: Path):
    torch.set_num_threads(td.THREADS)
    td.seed_all(SEED)
    target, config = load_target()
    head = init_head(target, config)
    train, held = tokens(out, "train"), tokens(out, "heldout")
    evalw = td.fixed_windows(held, TRAIN["seq_len"], limit=TRAIN["eval_windows"])
    opt = td.make_optimizer(head, TRAIN["lr"], TRAIN["weight_decay"], TRAIN["betas"])
    logf = out / "log.txt"

    def evaluate():
        head.eval()
        with torch.no_grad():
            r = [step_loss(target, head, evalw[i:i + 8]) for i in range(0, len(evalw), 8)]
        head.train()
        return float(np.mean([a.item() for a, _ in r])), float(np.mean([b.item() for _, b in r]))

    kl0, agree0 = evaluate()
    td.log(f"mtp init: heldout KL {kl0:.4f}, top-1 agreement {agree0:.4f}", logf)
    t0, step, decay_start, hist = time.time(), 0, None, []
    budget, decay = TRAIN["max_minutes"] * 60, TRAIN["decay_minutes"] * 60
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget:
            break
        if decay_start is None and elapsed >= budget - decay:
            # decay over the steps the remaining time holds at the rate so far
            decay_start, decay_steps = step, max(1, int(step * decay / max(elapsed, 1e-9)))
        lr = td.lr_at(step, TRAIN["lr"], TRAIN["warmup"], TRAIN["min_lr_frac"], decay_start,
                      decay_steps if decay_start is not None else None)
        for g in opt.param_groups:
            g["lr"] = lr
        w = td.batch_windows(train, step, TRAIN["batch"], TRAIN["seq_len"], SEED)
        kl, agree = step_loss(target, head, w)
        opt.zero_grad(set_to_none=True)
        kl.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), TRAIN["clip"])
        opt.step()
        hist.append((kl.item(), agree.item()))
        step += 1
        if step % TRAIN["log_every"] == 0:
            k, a = np.mean(hist[-TRAIN["log_every"]:], 0)
            td.log(f"mtp step {step} lr {lr:.2e} KL {k:.4f} agree {a:.3f} ({time.time() - t0:.0f}s)", logf)
    kl1, agree1 = evaluate()
    wall = time.time() - t0
    td.log(f"mtp done: {step} steps in {wall:.0f}s; heldout KL {kl1:.4f}, top-1 agreement {agree1:.4f}", logf)
    result = {"steps": step, "decay_start": decay_start, "tokens": step * TRAIN["batch"] * TRAIN["seq_len"],
              "wall_s": round(wall, 1), "heldout_kl_init": round(kl0, 4), "heldout_top1_init": round(agree0, 4),
              "heldout_kl": round(kl1, 4), "heldout_top1_agreement": round(agree1, 4),
              "final_train_kl_last50": round(float(np.mean([k for k, _ in hist[-50:]])), 4)}
    sd = {"mtp." + n: p.detach().clone() for n, p in head.state_dict().items()}
    torch.save({"state_dict": sd, "result": result, "train": TRAIN}, out / "mtp.pt")


def stage_export(out: Path):
    from sapwood.safetensors_io import read_header, read_safetensors
    from sapwood.testing import save_bf16

    st = torch.load(out / "mtp.pt", weights_only=False)
    f = TARGET_DIR / "model.safetensors"
    header, _, _ = read_header(f)
    old = read_safetensors(f)
    if any(n.startswith("mtp.") for n in old):
        raise SystemExit(f"{f} already has mtp.* tensors")
    old_bytes = {n: np.ascontiguousarray(x, np.float32) for n, x in old.items()}
    new = {n: t.numpy().astype(np.float32) for n, t in st["state_dict"].items()}
    # every existing tensor is bf16, so float32 -> bf16 gives back its bytes exactly
    save_bf16({**old_bytes, **new}, f, header.get("__metadata__", {"format": "pt"}))
    back = read_safetensors(f)
    assert all(np.array_equal(back[n], x) for n, x in old.items()), "an existing tensor changed"
    cfg_path = TARGET_DIR / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["mtp_num_hidden_layers"] = 1
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    recipe_path = td.EXPORT_DIR / "RECIPE.json"
    recipe = json.loads(recipe_path.read_text())
    recipe["mtp"] = {
        "description": "the target's MTP head (mtp.*, one full-attention layer; vLLM qwen3_5_mtp), "
                       "target frozen, trained to the target's own next-next-token distribution",
        "script": "scripts/train_mtp.py all", "seed": SEED, "torch": torch.__version__,
        "threads": td.THREADS, "loss": "KL(target at i+1 || head at i), depth 1",
        "params": int(sum(t.numel() for t in st["state_dict"].values())),
        "train": st["train"], "result": st["result"],
        "target_file_sha256_after": td.sha256_bytes(f.read_bytes()),
    }
    recipe_path.write_text(json.dumps(recipe, indent=1) + "\n")
    td.log(f"export: {len(new)} mtp.* tensors into {f}; recipe in {recipe_path}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["corpus", "train", "export", "all"])
    ap.add_argument("--out", type=Path, default=Path("/tmp/train_mtp"))
    ap.add_argument("--max-minutes", type=float, default=TRAIN["max_minutes"])
    a = ap.parse_args(argv)
    TRAIN["max_minutes"] = a.max_minutes
    TRAIN["decay_minutes"] = min(TRAIN["decay_minutes"], a.max_minutes / 4)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.stage in ("corpus", "all"):
        td.stage_corpus(a.out)
    if a.stage in ("train", "all"):
        stage_train(a.out)
    if a.stage in ("export", "all"):
        stage_export(a.out)


if __name__ == "__main__":
    main()
