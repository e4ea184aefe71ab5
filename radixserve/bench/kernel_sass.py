"""What the attention kernels compile to, without a GPU: JSON to stdout.

    python -m radixserve.bench.kernel_sass [--kernels decode extend] [--kv-cache-dtype fp8_e4m3] [--arch 90]

Triton compiles for an NVIDIA target on any machine (its wheel carries ptxas
and cuobjdump), so the machine code of the decode kernel's stage 1 and of
the extend kernel can be read where no GPU is: this compiles each as its
launcher does for llama-3.1-8b's heads (32 query heads, 8 KV heads, head
size 128) over a bf16 or fp8 pool, disassembles it, and counts the
instructions by opcode. The
counts say how a tile moves (``LDGSTS``: asynchronous copies to shared
memory; ``LDSM``: matrix loads from it; ``LDS.U8``: byte-wide loads;
``F2F``: one conversion per element), which decides whether the kernel can
read K/V at the memory's speed; ``tests/test_triton_codegen.py`` keeps the
fp8 paths free of the slow ones.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import tempfile
from collections import Counter

import torch
import triton

from radixserve.layers.attention.triton_ops import decode_attention as dec
from radixserve.layers.attention.triton_ops import extend_attention as ext
from radixserve.mem_cache.memory_pool import resolve_kv_cache_dtype

TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
# one line of cuobjdump's listing: /*0a30*/  [@P0 ]OPCODE.MODIFIERS operands ;
_SASS_LINE = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def cuobjdump_path() -> str:
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def compile_kernel(kernel: str, kv_dtype: torch.dtype, q_dtype: torch.dtype = torch.bfloat16, arch: int = 90,
                   heads: int = 32, kv_heads: int = 8, head_dim: int = 128):
    """The decode kernel's stage 1 (``_decode_split_kernel``), the extend
    kernel (``_extend_kernel``) or prefix-grouped decode's prefix kernel
    (``_prefix_split_kernel``) compiled for ``sm_<arch>`` with the launch
    config and constexprs their launchers use for a bf16 model and a large batch."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    q_t, kv_t = TRITON_TYPES[q_dtype], TRITON_TYPES[kv_dtype]
    pow2 = max(16, triton.next_power_of_2(head_dim))
    shape = dict(D=head_dim, BLOCK_D=pow2, DV=head_dim, BLOCK_DV=pow2,
                 DOT_PRECISION="ieee" if q_dtype == torch.float32 else "tf32")
    fp8 = dict(KV_FP8=kv_dtype in dec.FP8_DTYPES)
    if kernel == "decode":
        fn, cfg = dec._decode_split_kernel, dict(dec.STAGE1_CONFIG)
        pointers = {"Q": q_t, "K_buf": kv_t, "V_buf": kv_t, "Req_to_token": "i32", "Req_pool_indices": "i64",
                    "Seq_lens": "i64", "Starts": "i64", "Num_kv_splits": "i32", "Mid_o": "fp32", "Mid_lse": "fp32",
                    "Out": q_t, "Mid_po": "fp32", "Mid_plse": "fp32"}
        strides = ["stride_qb", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_r2t",
                   "stride_mo_b", "stride_mo_h", "stride_mo_s", "stride_ml_b", "stride_ml_h", "stride_ob", "stride_oh",
                   "stride_po_b", "stride_po_h", "stride_po_s", "stride_pl_b", "stride_pl_h"]
        const = dict(GROUP=heads // kv_heads, BLOCK_H=max(16, triton.next_power_of_2(heads // kv_heads)),
                     BLOCK_N=cfg.pop("BLOCK_N"), **shape, DOT_DTYPE=dec.dot_dtype(q_dtype, kv_dtype), **fp8,
                     HAS_START=False, WRITE_OUT=False, PREFIX_SPLITS=dec.PREFIX_SPLITS,
                     MIN_PREFIX_SPLIT=dec.MIN_PREFIX_SPLIT, USE_PDL=False)
        unaligned = {"stride_ml_h", "stride_pl_h"}  # the lse buffers' head strides are split counts
    elif kernel == "prefix":  # prefix-grouped decode's shared-prefix kernel
        fn, cfg = dec._prefix_split_kernel, dict(dec.PREFIX_CONFIG)
        group = heads // kv_heads
        pointers = {"Q": q_t, "K_buf": kv_t, "V_buf": kv_t, "Req_to_token": "i32", "Tiles": "i64",
                    "Num_tiles": "i64", "Members": "i64", "Mid_po": "fp32", "Mid_plse": "fp32"}
        strides = ["stride_qb", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_r2t",
                   "stride_tiles", "stride_po_b", "stride_po_h", "stride_po_s", "stride_pl_b", "stride_pl_h"]
        dims = {k: shape[k] for k in ("D", "BLOCK_D", "DV", "BLOCK_DV")}
        const = dict(GROUP=group, BLOCK_M=max(16, triton.next_power_of_2(dec.members_per_tile(group) * group)),
                     BLOCK_N=cfg.pop("BLOCK_N"), **dims, PREFIX_SPLITS=dec.PREFIX_SPLITS,
                     MIN_PREFIX_SPLIT=dec.MIN_PREFIX_SPLIT, DOT_PRECISION=shape["DOT_PRECISION"],
                     DOT_DTYPE=dec.dot_dtype(q_dtype, kv_dtype), **fp8)
        unaligned = {"stride_pl_h"}
    elif kernel == "extend":
        fn, cfg = ext._extend_kernel, dict(ext.EXTEND_CONFIG)
        pointers = {"Q": q_t, "K": q_t, "V": q_t, "O": q_t, "K_buf": kv_t, "V_buf": kv_t, "Req_to_token": "i32",
                    "Req_pool_indices": "i64", "Prefix_lens": "i64", "Extend_lens": "i64", "Extend_start": "i64"}
        strides = ["stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_ot",
                   "stride_oh", "stride_kbt", "stride_kbh", "stride_vbt", "stride_vbh", "stride_r2t"]
        const = dict(GROUP=heads // kv_heads, BLOCK_M=cfg.pop("BLOCK_M"), BLOCK_N=cfg.pop("BLOCK_N"), **shape,
                     POOL_DOT_DTYPE=dec.dot_dtype(q_dtype, kv_dtype), **fp8)
        unaligned = set()
    else:
        raise ValueError(f"unknown kernel {kernel!r}: decode or extend")
    sig = {**{name: f"*{t}" for name, t in pointers.items()}, "qk_scale": "fp32", "v_scale": "fp32",
           **{name: "i32" for name in strides}, **{name: "constexpr" for name in const}}
    names = list(sig)
    # what the launcher's specialisation sees at run time: pointers and strides are multiples of 16
    aligned = [n for n in names if n in pointers or (n in strides and n not in unaligned)]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=cfg)


def sass_opcodes(cubin: bytes) -> Counter:
    """Instructions of a cubin by full opcode (``LDS.U8``, ``HMMA.16816.F32``, ...)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        listing = subprocess.run([cuobjdump_path(), "-sass", f.name], check=True, capture_output=True,
                                 text=True).stdout
    return Counter(m.group(1) for line in listing.splitlines() if (m := _SASS_LINE.match(line)))


def summary(kv_cache_dtype: str, kernel: str = "decode", arch: int = 90) -> dict:
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, torch.bfloat16)
    compiled = compile_kernel(kernel, kv_dtype, arch=arch)
    ops = sass_opcodes(compiled.asm["cubin"])
    return {"bench": "kernel_sass", "kernel": kernel, "kv_cache_dtype": str(kv_dtype), "arch": f"sm_{arch}",
            "triton": triton.__version__, "config": {"decode": dec.STAGE1_CONFIG, "extend": ext.EXTEND_CONFIG, "prefix": dec.PREFIX_CONFIG}[kernel],
            "dot_dtype": str(dec.dot_dtype(torch.bfloat16, kv_dtype)), "shared_bytes": compiled.metadata.shared,
            "instructions": sum(ops.values()), "opcodes": dict(ops.most_common())}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-dtype", nargs="+", default=["bf16", "fp8_e4m3", "fp8_e5m2"])
    p.add_argument("--kernels", nargs="+", choices=["decode", "extend", "prefix"], default=["decode", "extend"])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper, 89: Ada)")
    args = p.parse_args()
    for kernel in args.kernels:
        for name in args.kv_cache_dtype:
            print(json.dumps(summary(name, kernel, args.arch)), flush=True)


if __name__ == "__main__":
    main()
