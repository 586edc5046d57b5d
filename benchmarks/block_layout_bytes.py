"""Bytes of int8 moments under two block layouts, on the parameter shapes of real models.

    python benchmarks/block_layout_bytes.py

``flat`` (format 1): blocks of 256 consecutive elements of the whole tensor, for every tensor of 4096
elements or more; a block can straddle an FSDP2 ``Shard(0)`` boundary, so its scales depend on the
sharding. ``rows`` (format 2, [note: blocks in rows] in ampfused/_contract.py): blocks of 256 within
each dim-0 row (the last one of a row may be short), for tensors of two or more dimensions and 4096
elements or more; 1-D tensors keep fp32 moments. Prints, per model, the share of params whose
moments are int8 codes and the moment bytes per param (codes + fp32 scales of exp_avg and
exp_avg_sq, fp32 moments elsewhere). The results are in docs/results/block-layout.md.
"""
from __future__ import annotations

import math

from ampfused._contract import SCALE_BLOCK, SMALL_TENSOR_NUMEL, scales_shape
from ampfused.bench.configs import GPT2_124M, LLAMA_7B

FP32_MOMENTS = 8  # bytes per element of fp32 exp_avg + exp_avg_sq
CODES = 2  # an int8 exp_avg code and a uint8 exp_avg_sq code
SCALE = 4  # one fp32 scale per block, per moment


def resnet50() -> list[tuple[int, ...]]:
    """torchvision's resnet50 parameter shapes (convolutions, batch norms, the classifier)."""
    shapes = [(64, 3, 7, 7), (64,), (64,)]
    in_ch = 64
    for width, blocks in ((64, 3), (128, 4), (256, 6), (512, 3)):
        for b in range(blocks):
            out = width * 4
            shapes += [(width, in_ch, 1, 1), (width,), (width,), (width, width, 3, 3), (width,), (width,),
                       (out, width, 1, 1), (out,), (out,)]
            if b == 0:
                shapes += [(out, in_ch, 1, 1), (out,), (out,)]
            in_ch = out
    return shapes + [(1000, 2048), (1000,)]


def vit_b16() -> list[tuple[int, ...]]:
    """ViT-B/16's parameter shapes (patch embedding as a convolution, 12 blocks, head)."""
    block = [(768,), (768,), (2304, 768), (2304,), (768, 768), (768,), (768,), (768,), (3072, 768), (3072,),
             (768, 3072), (768,)]
    return [(768, 3, 16, 16), (768,), (1, 1, 768), (1, 197, 768)] + block * 12 + [(768,), (768,), (1000, 768), (1000,)]


def tiny_gpt() -> list[tuple[int, ...]]:
    """The CPU training benchmark's model (benchmarks/bench_train.py, preset cpu: 2 layers, d=64, bytes)."""
    block = [(64,), (64,), (192, 64), (192,), (64, 64), (64,), (64,), (64,), (256, 64), (256,), (64, 256), (64,)]
    return [(256, 64), (64, 64)] + block * 2 + [(64,), (64,)]


def moment_bytes(shape, layout: str) -> tuple[int, bool]:
    """(bytes of exp_avg + exp_avg_sq, whether they are int8 codes) of a tensor of ``shape``."""
    numel = math.prod(shape)
    if numel < SMALL_TENSOR_NUMEL or (layout == "rows" and len(shape) < 2):
        return FP32_MOMENTS * numel, False
    blocks = -(-numel // SCALE_BLOCK) if layout == "flat" else math.prod(scales_shape(shape))
    return CODES * numel + 2 * SCALE * blocks, True


def main() -> None:
    models = {"GPT-2 124M": GPT2_124M, "LLaMA-7B": LLAMA_7B, "ViT-B/16": vit_b16(), "ResNet-50": resnet50(),
              "bench_train cpu (d=64)": tiny_gpt()}
    print("| model | params | layout | int8 share | moment B/param | scales B/param |")
    print("|---|---:|---|---:|---:|---:|")
    for name, shapes in models.items():
        total = sum(math.prod(s) for s in shapes)
        for layout in ("flat", "rows"):
            parts = [(moment_bytes(s, layout), math.prod(s)) for s in shapes]
            coded = sum(n for (_, int8), n in parts if int8)
            nbytes = sum(b for (b, _), _ in parts)
            scales = sum(b - CODES * n for (b, int8), n in parts if int8)
            print(f"| {name} | {total / 1e6:.2f}M | {layout} | {coded / total:.2%} | {nbytes / total:.4f} | "
                  f"{scales / total:.4f} |")


if __name__ == "__main__":
    main()
