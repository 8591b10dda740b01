"""How much each gate fixture behaves like a trained model: attention peaking, outlier channels, output peaking.

    PYTHONPATH=$PWD .venv/bin/python bench/fixture_shape.py     # -> bench/results/fixture-shape.json, a table on stdout

For every fixture of gates/refdata/fixture.SPECS but llama-1k (generated into a temporary folder, sha256 checked),
a float32 forward pass of its first 16 prompts with transformers' eager attention (the one that returns the
attention probabilities), measuring:

- attention: the normalised entropy H(p) / log(t + 1) of every head's attention row at every position t >= 8
  (1 = uniform over the visible keys, 0 = one key): mean, median, 10th percentile;
- activations: for the input of every matrix product (q/k/v projections, the router, the experts' and MLP's
  first projection), each channel's largest magnitude over all tokens, as max channel / median channel;
- the final hidden state (what model.hidden holds): the same ratio over its channels, and its largest value;
- outputs: the mean probability of the top next token (1 / vocab for a uniform distribution);
- positions: the longest prompt, so the largest rotary position reached.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from skupin.gates.refdata import fixture  # noqa: E402

OUT = ROOT / "bench/results/fixture-shape.json"
PROMPTS = 16
FIRST_POSITION = 8
READS = ("q_proj", "k_proj", "v_proj", "gate", "gate_proj", "up_proj", "experts")


def measure(folder: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    doc = json.loads((folder / "prompts.json").read_text(encoding="utf-8"))
    ids = [p["ids"] for p in doc["prompts"]][:PROMPTS]
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, attn_implementation="eager").eval()
    channel_max: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_module, args, _output):
            x = args[0].detach().float().reshape(-1, args[0].shape[-1]).abs().amax(0)
            channel_max[name] = torch.maximum(channel_max[name], x) if name in channel_max else x
        return hook

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in READS:
            module.register_forward_hook(record(name))
    entropies, top1, hidden_max = [], [], None
    with torch.no_grad():
        for prompt in ids:
            out = model(input_ids=torch.tensor([prompt]), output_attentions=True, output_hidden_states=True)
            for attn in out.attentions:  # [1, heads, T, T]
                for t in range(FIRST_POSITION, attn.shape[-1]):
                    row = attn[0, :, t, : t + 1].clamp_min(1e-30)
                    entropies.extend((-(row * row.log()).sum(-1) / np.log(t + 1)).tolist())
            top1.append(float(torch.softmax(out.logits[0].float(), -1).amax(-1).mean()))
            h = out.hidden_states[-1][0].abs().amax(0)
            hidden_max = h if hidden_max is None else torch.maximum(hidden_max, h)
    ratios = [float(v.max() / v.median()) for v in channel_max.values()]
    e = np.array(entropies)
    return {
        "attention_entropy": {"mean": round(float(e.mean()), 3), "median": round(float(np.median(e)), 3),
                              "p10": round(float(np.percentile(e, 10)), 3)},
        "activation_outlier_ratio": {"median": round(float(np.median(ratios)), 2), "max": round(max(ratios), 2)},
        "hidden_outlier_ratio": round(float(hidden_max.max() / hidden_max.median()), 2),
        "hidden_max": round(float(hidden_max.max()), 2),
        "top1_probability": round(float(np.mean(top1)), 4),
        "uniform_probability": round(1 / model.config.vocab_size, 6),
        "longest_prompt": max(len(p["ids"]) for p in doc["prompts"]),
    }


def main() -> int:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in fixture.SPECS:
            if name == "llama-1k":
                continue
            folder = Path(tmp) / name
            fixture.generate_fixture(name=name, out=folder)
            results[name] = measure(folder)
    OUT.write_text(json.dumps(results, indent=1) + "\n", encoding="utf-8")
    print("| fixture | attention entropy mean (p10) | activation outliers max/median | hidden max/median | "
          "top-1 prob | longest prompt |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        a = r["attention_entropy"]
        print(f"| {name} | {a['mean']} ({a['p10']}) | {r['activation_outlier_ratio']['max']} | "
              f"{r['hidden_outlier_ratio']} | {r['top1_probability']} | {r['longest_prompt']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
