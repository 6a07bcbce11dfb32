"""Predict every published training-scaling row in benchmarks/published/training_scaling.json.

    python benchmarks/bench_plan_scaling.py            # per-row table, summary, held-out view

Each row is a published data-parallel throughput at N GPUs against N x the 1-GPU throughput at
the same per-GPU batch (weak scaling). The planner gets only what a user would have known: the
model's parameter count (counted here by building the architecture with torch.nn), the 1-GPU
step time (batch / published 1-GPU throughput), the ``--link`` preset and ``--strategies ddp``.
The error is in points of efficiency (predicted - published; positive = optimistic). The
leave-one-source-out view rebuilds every constant that is calibrated on training rows from the
*other* sources (see :func:`held_out_cv`) and predicts the held-out source with it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from torch import nn

from lockstep.plan import describe, parse_topology, plan
from lockstep.plan.model import PlanOptions
from lockstep.plan.stragglers import DEFAULT_CV, expected_max_normal

HERE = Path(__file__).resolve().parent / "published"


def _bottleneck_params(inp: int, width: int, out: int, groups: int, stride: int, se: int) -> int:
    layers: list[nn.Module] = [
        nn.Conv2d(inp, width, 1, bias=False), nn.BatchNorm2d(width),
        nn.Conv2d(width, width, 3, stride, 1, groups=groups, bias=False), nn.BatchNorm2d(width),
        nn.Conv2d(width, out, 1, bias=False), nn.BatchNorm2d(out)]
    if se:  # squeeze-and-excitation: two 1x1 convolutions with bias, reduction ``se``
        layers += [nn.Conv2d(out, out // se, 1), nn.Conv2d(out // se, out, 1)]
    if stride != 1 or inp != out:
        layers += [nn.Conv2d(inp, out, 1, stride, bias=False), nn.BatchNorm2d(out)]
    return sum(p.numel() for m in layers for p in m.parameters())


def resnet_params(blocks: tuple[int, ...], groups: int = 1, width_per_group: int = 64,
                  se: int = 0, classes: int = 1000) -> int:
    """Trainable parameters of a bottleneck ResNet/ResNeXt/SE-ResNeXt, counted on torch.nn."""
    total = sum(p.numel() for m in (nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64))
                for p in m.parameters())
    inp = 64
    for stage, count in enumerate(blocks):
        planes = 64 * 2 ** stage
        width, out = int(planes * width_per_group / 64) * groups, planes * 4
        for i in range(count):
            total += _bottleneck_params(inp, width, out, groups, 2 if i == 0 and stage else 1, se)
            inp = out
    return total + inp * classes + classes


def bert_params(vocab: int = 30522, hidden: int = 768, layers: int = 12, ffn: int = 3072,
                positions: int = 512, types: int = 2) -> int:
    """Trainable parameters of BERT for pre-training (encoder, pooler, MLM head with the decoder
    tied to the word embeddings, NSP head), counted on torch.nn. Defaults: BERT-base's released
    configuration (Devlin et al. 2018, bert_config.json of BERT-Base, Uncased)."""
    parts: list[nn.Module] = [nn.Embedding(vocab, hidden), nn.Embedding(positions, hidden),
                              nn.Embedding(types, hidden), nn.LayerNorm(hidden)]
    for _ in range(layers):
        parts += [nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden), nn.LayerNorm(hidden),
                  nn.Linear(hidden, ffn), nn.Linear(ffn, hidden), nn.LayerNorm(hidden)]
    parts += [nn.Linear(hidden, hidden),  # pooler
              nn.Linear(hidden, hidden), nn.LayerNorm(hidden),  # MLM transform
              nn.Linear(hidden, 2)]  # next-sentence head
    return sum(p.numel() for m in parts for p in m.parameters()) + vocab  # + MLM output bias


def _conv_bn(inp: int, out: int, kernel: int | tuple[int, int], stride: int = 1) -> list[nn.Module]:
    return [nn.Conv2d(inp, out, kernel, stride, bias=False), nn.BatchNorm2d(out, eps=0.001)]


def inception_v3_params(classes: int = 1000, aux: bool = False) -> int:
    """Trainable parameters of Inception v3 (Szegedy et al. 2015, arXiv:1512.00567), counted on
    torch.nn with torchvision's layout (every convolution without bias, then batch norm). With
    ``aux`` it is torchvision's ``inception_v3`` (27,161,264); without, the network alone (what
    TensorFlow's tf_cnn_benchmarks builds: assumed)."""
    c = _conv_bn
    layers = c(3, 32, 3, 2) + c(32, 32, 3) + c(32, 64, 3) + c(64, 80, 1) + c(80, 192, 3)

    def a(i: int, pool: int) -> list[nn.Module]:
        return (c(i, 64, 1) + c(i, 48, 1) + c(48, 64, 5) + c(i, 64, 1) + c(64, 96, 3)
                + c(96, 96, 3) + c(i, pool, 1))

    def b(i: int) -> list[nn.Module]:
        return c(i, 384, 3, 2) + c(i, 64, 1) + c(64, 96, 3) + c(96, 96, 3, 2)

    def cc(i: int, w: int) -> list[nn.Module]:
        return (c(i, 192, 1) + c(i, w, 1) + c(w, w, (1, 7)) + c(w, 192, (7, 1)) + c(i, w, 1)
                + c(w, w, (7, 1)) + c(w, w, (1, 7)) + c(w, w, (7, 1)) + c(w, 192, (1, 7))
                + c(i, 192, 1))

    def d(i: int) -> list[nn.Module]:
        return (c(i, 192, 1) + c(192, 320, 3, 2) + c(i, 192, 1) + c(192, 192, (1, 7))
                + c(192, 192, (7, 1)) + c(192, 192, 3, 2))

    def e(i: int) -> list[nn.Module]:
        return (c(i, 320, 1) + c(i, 384, 1) + c(384, 384, (1, 3)) + c(384, 384, (3, 1))
                + c(i, 448, 1) + c(448, 384, 3) + c(384, 384, (1, 3)) + c(384, 384, (3, 1))
                + c(i, 192, 1))

    layers += (a(192, 32) + a(256, 64) + a(288, 64) + b(288) + cc(768, 128) + cc(768, 160)
               + cc(768, 160) + cc(768, 192) + d(768) + e(1280) + e(2048))
    layers.append(nn.Linear(2048, classes))
    if aux:
        layers += c(768, 128, 1) + c(128, 768, 5) + [nn.Linear(768, classes)]
    return sum(p.numel() for m in layers for p in m.parameters())


# The SE reduction ratio 16 is Hu et al., "Squeeze-and-Excitation Networks" (CVPR 2018)'s default.
MODELS = {"resnet50": lambda: resnet_params((3, 4, 6, 3)),
          "resnext101_32x4d": lambda: resnet_params((3, 4, 23, 3), groups=32, width_per_group=4),
          "se_resnext101_32x4d": lambda: resnet_params((3, 4, 23, 3), groups=32,
                                                       width_per_group=4, se=16),
          "bert_base": bert_params,
          "resnet152": lambda: resnet_params((3, 8, 36, 3)),
          "inception_v3": inception_v3_params,
          "resnet101": lambda: resnet_params((3, 4, 23, 3)),
          "resnext50_32x4d": lambda: resnet_params((3, 4, 6, 3), groups=32, width_per_group=4),
          "resnext101_32x8d": lambda: resnet_params((3, 4, 23, 3), groups=32, width_per_group=8)}


def _count(*modules: nn.Module) -> int:
    return sum(p.numel() for m in modules for p in m.parameters())


# The input layer of each model, counted on torch.nn: backward computes its gradient last, so
# ``describe(input_parameters=...)`` makes it a last bucket ready at the end of backward. BERT's
# embeddings (token, position, type, their LayerNorm: 23.8M of 110.1M; the MLM decoder is tied to
# the token embedding, whose gradient is complete only then); a ResNet's 7x7 stem and its batch
# norm; Inception v3's first 3x3 convolution and batch norm.
INPUT_LAYERS = {"resnet50": lambda: _count(nn.Conv2d(3, 64, 7, 2, 3, bias=False),
                                           nn.BatchNorm2d(64)),
                "resnext101_32x4d": lambda: INPUT_LAYERS["resnet50"](),
                "se_resnext101_32x4d": lambda: INPUT_LAYERS["resnet50"](),
                "resnet152": lambda: INPUT_LAYERS["resnet50"](),
                "resnet101": lambda: INPUT_LAYERS["resnet50"](),
                "resnext50_32x4d": lambda: INPUT_LAYERS["resnet50"](),
                "resnext101_32x8d": lambda: INPUT_LAYERS["resnet50"](),
                "bert_base": lambda: _count(nn.Embedding(30522, 768), nn.Embedding(512, 768),
                                            nn.Embedding(2, 768), nn.LayerNorm(768)),
                "inception_v3": lambda: _count(*_conv_bn(3, 32, 3, 2))}


def implied_cv(row: dict, params: dict[str, int]) -> float:
    """The step-time spread that, priced as the wait for the slowest of N (order statistics of a
    normal), closes the gap between the no-spread prediction and the published row:
    ``(1/published - 1/predicted) / E[max of N]`` (0 where the prediction is already lower)."""
    e0 = predict_row(row, params, cv=0.0)["predicted"]
    gap = 1 / row["efficiency"] - 1 / e0
    return max(0.0, gap / expected_max_normal(row["gpus"]))


def calibrated_cv(rows: list[dict], params: dict[str, int]) -> tuple[float, float, float]:
    """(min, median, max) of the implied spreads of ``rows``: the no-profile default range."""
    cvs = sorted(implied_cv(r, params) for r in rows)
    return cvs[0], statistics.median(cvs), cvs[-1]


def predict_row(row: dict, params: dict[str, int], cv: float | None = None,
                default_cv: tuple[float, float, float] | None = None) -> dict:
    """Expected, low and high efficiency for ``row`` as ``lockstep plan`` would print them."""
    dtype = "float16" if row["source"].startswith("DLE MXNet") and row["precision"] == "amp" \
        else "float32"
    work = describe(params[row["model"]], step_time=row["batch_per_gpu"] / row["throughput_1gpu"],
                    batch_size=row["batch_per_gpu"], dtype=dtype,
                    input_parameters=INPUT_LAYERS[row["model"]]())
    options = PlanOptions(step_cv=cv, default_cv=default_cv or DEFAULT_CV)
    result = plan(work, parse_topology(row["link"]), gpus=[row["gpus"]], strategies="ddp",
                  options=options, intervals=True)
    p = result.predictions[0]
    return {"predicted": p.efficiency, "low": p.detail["efficiency_low"],
            "high": p.detail["efficiency_high"], "dominant": p.detail["dominant_input"]}


def judge(rows: list[dict], params: dict[str, int],
          default_cv: tuple[float, float, float] | None = None) -> list[dict]:
    out = []
    for row in rows:
        pred = predict_row(row, params, default_cv=default_cv)
        measured = row["efficiency"]
        label = row["source"] + (f" / {row['column']}" if "column" in row else "")
        out.append({**pred, "source": label, "model": row["model"], "link": row["link"],
                    "gpus": row["gpus"], "precision": row["precision"], "measured": measured,
                    "error": (pred["predicted"] - measured) * 100,
                    "covered": pred["low"] - 5e-4 <= measured <= pred["high"] + 5e-4})
    return out


def summary(judged: list[dict]) -> str:
    errs = [j["error"] for j in judged]
    within = sum(abs(e) <= 10 for e in errs)
    optimistic = sum(e > 0 for e in errs)
    covered = sum(j["covered"] for j in judged)
    return (f"{len(judged)} rows: {within}/{len(judged)} within 10 points, mean |error| "
            f"{statistics.mean(abs(e) for e in errs):.1f} points, mean signed "
            f"{statistics.mean(errs):+.1f}; optimistic {optimistic}, pessimistic "
            f"{len(errs) - optimistic}; interval covers {covered}/{len(judged)}")


def table_text(judged: list[dict]) -> str:
    head = (f"{'source':<40} {'model':<20} {'link':<21} {'GPUs':>4} {'prec':<5} "
            f"{'published':>9} {'predicted':>9} {'range':>9} {'error':>6} covered")
    lines = [head]
    for j in judged:
        lines.append(f"{j['source'][-40:]:<40} {j['model']:<20} {j['link']:<21} {j['gpus']:>4} "
                     f"{j['precision']:<5} {j['measured'] * 100:>8.1f}% "
                     f"{j['predicted'] * 100:>8.1f}% {j['low'] * 100:>4.0f}-{j['high'] * 100:<3.0f}% "
                     f"{j['error']:>+6.1f} {'yes' if j['covered'] else 'NO'}")
    return "\n".join(lines)


def main() -> None:
    rows = json.loads((HERE / "training_scaling.json").read_text())["rows"]
    params = {name: count() for name, count in MODELS.items()}
    print("parameters counted on torch.nn:", params, "\n")
    judged = judge(rows, params)
    print(table_text(judged))
    print("\nall constants as shipped:", summary(judged))
    every = calibrated_cv(rows, params)
    print("\nspread implied by all rows (min, median, max):",
          ", ".join(f"{c:.3f}" for c in every))
    held: list[dict] = []
    for source in dict.fromkeys(r["source"] for r in rows):
        rest = [r for r in rows if r["source"] != source]
        cv = calibrated_cv(rest, params)
        print(f"  held out {source}: default spread from the others "
              f"{cv[0]:.3f} / {cv[1]:.3f} / {cv[2]:.3f}")
        held += judge([r for r in rows if r["source"] == source], params, cv)
    print("\nleave one source out (default spread rebuilt without the held-out source's rows)\n")
    print(table_text(held))
    print("\nleave one source out:", summary(held))
    for source in dict.fromkeys(r["source"] for r in rows):
        part = [j for j in held if j["source"].startswith(source)]
        print(f"  {source}: {summary(part)}")


if __name__ == "__main__":
    main()
