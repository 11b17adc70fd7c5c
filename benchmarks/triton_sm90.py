"""Compile the Triton attention kernels for Hopper (sm_90) on any machine, and report on them.

No GPU is needed: Triton's wheel carries ``ptxas`` and ``cuobjdump``, so each autotuning
configuration of the forward, dK/dV and dQ kernels, each tiling of the Gluon forward
(``hopper_forward``) and the Gluon backward (``hopper_backward``) is compiled ahead of time
for compute capability 9.0, bf16, and the cubin is read back. One markdown row per configuration:
instructions per iteration of each wgmma loop (``total/common`` where a branch in it can
skip a block), registers per thread, stack bytes (spills), shared memory, and the counts of Hopper's
instructions that matter here: ``HGMMA`` (wgmma, the tensor cores), ``UTMALDG`` (TMA loads)
and ``REDG`` (atomic adds to global memory: the atomic backward plan's dQ); and how many
exp2 issue while a wgmma still runs (the softmax overlapping the tensor cores, which the Gluon
forward is written for). A row marked "pruned" is one the kernel's autotune pruner drops for
that head dim.

This is how a session without a GPU checks that a kernel change still compiles for the H200,
does not spill, and still uses wgmma, before it spends device time. ``--capability`` compiles
the Triton kernels for another GPU instead (8.0: A100; 8.6, 8.9: RTX 30 and 40, A10, L4, with
99 KiB of shared memory per block), with that GPU's shared-memory budget in the pruner, so
that what the pruner keeps there can be seen to fit (``--kept-only``: compile just that):

    python benchmarks/triton_sm90.py                     # all kernels, D 64 and 128
    python benchmarks/triton_sm90.py --kernels forward dq --head-dims 128
    python benchmarks/triton_sm90.py --capability 86 --head-dims 256 --kept-only
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from selfattn.kernels import hopper_backward, hopper_forward
from selfattn.kernels import triton_attention as kernels

HOPPER = 90
# Shared memory a block may take (the opt-in maximum), in bytes, by compute capability.
SHARED_MEMORY = {80: 166_912, 86: 101_376, 89: 101_376, 90: 232_448}
GLUON = "gluon forward"
GLUON_BACKWARD = "gluon backward"
GLUON_HEAD_DIMS = hopper_forward.HEAD_DIMS  # both Gluon kernels' scope (``in_scope``)
GLUON_SCOPE = "D = " + " or ".join(map(str, GLUON_HEAD_DIMS))
POINTERS_FP32 = {"Lse", "Delta", "DQAcc", "DQ"}
INTS = {"inner", "T", "S", "t_bucket", "s_bucket", "gpu"}
FLOATS = {"qk_scale", "scale"}


def compile_config(
    jit_fn, config: triton.Config, head_dim: int, causal: bool, capability: int, **variant
):
    """Compile one kernel and configuration for ``capability`` (90: sm_90): bf16, contiguous,
    no mask, aligned; TMA loads from Hopper on.

    ``variant`` holds the kernel's other compile-time switches (ATOMIC_DQ for dK/dV)."""
    constants = dict(
        **variant,
        HEAD_DIM=head_dim,
        VALUE_DIM=head_dim,
        BLOCK_D=head_dim,
        BLOCK_DV=head_dim,
        CAUSAL=causal,
        MASK_KIND=kernels.MASK_NONE,
        PRECISION="tf32",
        **config.kwargs,
    )
    if "TMA_OK" in jit_fn.arg_names:
        constants["TMA_OK"] = capability >= HOPPER
    signature, attributes = {}, {}
    for index, name in enumerate(jit_fn.arg_names):
        aligned = [["tt.divisibility", 16]]
        if name in constants:
            signature[name] = "constexpr"
        elif name in POINTERS_FP32:
            signature[name], attributes[(index,)] = "*fp32", aligned
        elif name in FLOATS:
            signature[name] = "fp32"
        elif name in INTS or name.startswith("stride_"):
            if name.startswith("stride_m"):  # no mask: its strides are 0
                signature[name], constants[name] = "constexpr", 0
            elif name.startswith("stride_") and name.endswith("d"):  # unit last stride
                signature[name], constants[name] = "constexpr", 1
            else:
                signature[name], attributes[(index,)] = "i32", aligned
        else:  # Q, K, V, Mask, Out, DOut, DQ, DK, DV
            signature[name], attributes[(index,)] = "*bf16", aligned
    source = ASTSource(jit_fn, signature, constants, attributes)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.maxnreg:
        options["maxnreg"] = config.maxnreg
    return triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)


def compile_gluon(
    config: hopper_forward.Config, head_dim: int, causal: bool, interleaved: bool = False
):
    """Compile one tiling of the Gluon forward (``hopper_forward``) for sm_90, bf16, for
    (N, T, D) inputs or, ``interleaved``, for (B, H, T, D) views of (B, T, H, D) ones."""
    jit_fn = hopper_forward._pingpong_kernel if config.pingpong else hopper_forward._forward_kernel
    rows = {"q_desc": config.block_m, "k_desc": config.block_n, "v_desc": config.block_n,
            "o_desc": config.block_m}  # fmt: skip
    constants = {"CAUSAL": causal, "INTERLEAVED": interleaved, "NUM_STAGES": config.stages,
                 "Q_IN_REGISTERS": config.q_in_registers}  # fmt: skip
    return compile_gluon_kernel(jit_fn, head_dim, rows, constants, config.num_warps)


def compile_gluon_backward(
    config: hopper_backward.Config, head_dim: int, causal: bool, interleaved: bool = False
):
    """Compile one tiling of the Gluon backward (``hopper_backward``) for sm_90, bf16, as
    above."""
    queries, keys = config.block_m, config.block_n
    rows = {"q_desc": queries, "do_desc": queries, "k_desc": keys, "v_desc": keys,
            "dk_desc": keys, "dv_desc": keys}  # fmt: skip
    constants = {"CAUSAL": causal, "INTERLEAVED": interleaved, "NUM_STAGES": config.stages}
    jit_fn = hopper_backward._backward_kernel
    return compile_gluon_kernel(jit_fn, head_dim, rows, constants, config.num_warps)


def compile_gluon_kernel(jit_fn, head_dim: int, rows: dict, constants: dict, num_warps: int):
    """Compile a Gluon kernel for sm_90: its tensor descriptors' (rows, head_dim) bf16 blocks
    by argument name, its compile-time constants, its other arguments by name."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    def descriptor(rows: int) -> str:  # the type Triton gives a host-side TensorDescriptor
        layout = gl.NVMMASharedLayout.get_default_for([rows, head_dim], gl.bfloat16)
        return f"tensordesc<bf16[{rows}, {head_dim}],{layout!r}>"

    constants = {**constants, "num_warps": num_warps}
    signature, attributes = {}, {}
    for index, name in enumerate(jit_fn.arg_names):
        if name in rows:
            signature[name] = descriptor(rows[name])
        elif name in constants:
            signature[name] = "constexpr"
        elif name in FLOATS:
            signature[name] = "fp32"
        else:
            signature[name] = "*fp32" if name in POINTERS_FP32 else "i32"
            attributes[(index,)] = [["tt.divisibility", 16]]
    source = GluonASTSource(jit_fn, signature, constants, attributes)
    target = GPUTarget("cuda", HOPPER, 32)
    return triton.compile(source, target=target, options={"num_warps": num_warps})


def read_cubin(cubin: bytes) -> dict[str, int]:
    """Registers, stack bytes and instruction counts from a cubin, via Triton's cuobjdump."""
    tools = Path(triton.backends.nvidia.__file__).parent / "bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as handle:
        handle.write(cubin)
        handle.flush()
        usage = _run(tools / "cuobjdump", "--dump-resource-usage", handle.name)
        sass = _run(tools / "cuobjdump", "--dump-sass", handle.name)
    return {
        "loop": loop_sizes(sass),
        "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
        "stack": int(re.search(r"STACK:(\d+)", usage).group(1)),
        "hgmma": sass.count("HGMMA"),
        "tma_loads": sass.count("UTMALDG"),
        "reductions": len(re.findall(r"\bREDG?\.", sass)),
        "exp2": exp2_under_wgmma(sass),
    }


def exp2_under_wgmma(sass: str) -> str:
    """How many of the kernel's exp2 (``MUFU.EX2``) issue while a wgmma is still running: after
    a wgmma group's last ``HGMMA`` and before the wait that drains it to zero. This is the
    softmax overlapping the tensor cores within a warpgroup, as "under/all"."""
    under = total = 0
    running = False
    for line in sass.splitlines():
        if "HGMMA" in line and "gsb0" in line:
            running = True
        elif "WARPGROUP.DEPBAR.LE gsb0, 0x0" in line:
            running = False
        elif "MUFU.EX2" in line:
            total += 1
            under += running
    return f"{under}/{total}"


def loop_sizes(sass: str) -> str:
    """Instructions per iteration of each innermost loop that runs wgmma, in code order (the
    forward: unmasked key tiles, then masked ones), each as "total" or "total/common" when a
    conditional branch inside it can skip a block (the common path being the one that does)."""
    code = [
        (int(address, 16), text.strip())
        for address, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]+);", sass)
    ]
    jumps = [
        (address, int(target, 16), text.startswith("@"))
        for address, text in code
        for target in re.findall(r"BRA\s+0x([0-9a-f]+)", text)
    ]

    def runs_wgmma(start: int, end: int) -> bool:
        return any(start <= address <= end and "HGMMA" in text for address, text in code)

    def exits(start: int, end: int) -> bool:  # a wait's retry branch jumps back from past EXIT
        return any(start <= address <= end and text.startswith("EXIT") for address, text in code)

    loops = [(target, address) for address, target, _ in jumps if target < address]
    loops = [loop for loop in loops if runs_wgmma(*loop) and not exits(*loop)]
    innermost = [
        (start, end)
        for start, end in loops
        if not any(start <= inner[0] and inner[1] <= end and inner != (start, end)
                   for inner in loops)
    ]  # fmt: skip
    sizes = []
    for start, end in sorted(innermost):
        total = sum(1 for address, _ in code if start <= address <= end)
        skipped = sum(
            sum(1 for address, _ in code if source < address < target)
            for source, target, conditional in jumps
            if conditional and start < source < target <= end
        )
        sizes.append(f"{total}/{total - skipped}" if skipped else str(total))
    return ", ".join(sizes) or "-"


def _run(*command) -> str:
    return subprocess.run(command, capture_output=True, text=True, check=True).stdout


def variants(name: str) -> dict[str, dict]:
    """The compile-time switches a kernel is launched with, by a label for the table."""
    if name == "dk/dv":
        return {"dk/dv": {"ATOMIC_DQ": False}, "dk/dv + atomic dq": {"ATOMIC_DQ": True}}
    return {name: {}}


def kept(autotuned, head_dim: int, capability: int) -> list[triton.Config]:
    """What the kernel's own autotune pruner keeps for bf16 inputs that suit TMA, with the
    shared memory of a GPU of that capability."""
    bf16 = {"Q": torch.empty(0, dtype=torch.bfloat16)}
    budget = min(kernels.SHARED_MEMORY_BUDGET, SHARED_MEMORY[capability])
    tma = capability >= HOPPER
    return autotuned.early_config_prune(
        autotuned.configs, bf16, budget, BLOCK_D=head_dim, BLOCK_DV=head_dim, TMA_OK=tma
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    names = [*kernels.AUTOTUNED, GLUON, GLUON_BACKWARD]
    parser.add_argument(
        "--kernels", nargs="+", choices=names, default=names, help="what to compile (default: all)"
    )
    parser.add_argument(
        "--head-dims",
        type=int,
        nargs="+",
        default=[64, 128],
        help=f"head dims D (default 64 128; the Gluon kernels take only {GLUON_SCOPE})",
    )
    parser.add_argument(
        "--causal", choices=["no", "yes", "both"], default="both", help="causal masking or not"
    )
    parser.add_argument(
        "--capability",
        type=int,
        choices=sorted(SHARED_MEMORY),
        default=HOPPER,
        help="the GPU's compute capability, 86 for 8.6 (default 90: Hopper)",
    )
    parser.add_argument(
        "--kept-only", action="store_true", help="only the tilings the pruner keeps"
    )
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        parser.error("unset TRITON_INTERPRET: this compiles real kernels")
    if args.capability != HOPPER and {GLUON, GLUON_BACKWARD} & set(args.kernels):
        parser.error("the Gluon kernels are for Hopper only: leave out --capability")
    causal_values = {"no": [False], "yes": [True], "both": [False, True]}[args.causal]

    print(f"# Triton {triton.__version__} kernels compiled for sm_{args.capability} (bf16)\n")
    outside = ", ".join(str(d) for d in args.head_dims if d not in GLUON_HEAD_DIMS)
    if outside and {GLUON, GLUON_BACKWARD} & set(args.kernels):
        print(f"The Gluon kernels skip D = {outside}: they take only {GLUON_SCOPE}.\n")
    header = ["kernel", "D", "causal", "configuration", "loop instr", "regs", "stack B"]
    header += ["smem KiB", "HGMMA", "UTMALDG", "REDG", "exp2 under wgmma", "compile s"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name in args.kernels:
        if name == GLUON:  # no autotune pruner; both input layouts
            for head_dim, causal, interleaved, config in itertools.product(
                args.head_dims, causal_values, (False, True), hopper_forward.CONFIGS
            ):
                if head_dim not in config.head_dims:
                    continue
                compile_one = partial(compile_gluon, config, head_dim, causal, interleaved)
                label = config.describe() + (" interleaved" if interleaved else "")
                report(name, compile_one, label, head_dim, causal)
            continue
        if name == GLUON_BACKWARD:
            for head_dim, causal, interleaved, config in itertools.product(
                args.head_dims, causal_values, (False, True), hopper_backward.CONFIGS
            ):
                if head_dim not in GLUON_HEAD_DIMS:
                    continue
                compile_one = partial(compile_gluon_backward, config, head_dim, causal, interleaved)
                label = config.describe() + (" interleaved" if interleaved else "")
                report(name, compile_one, label, head_dim, causal)
            continue
        autotuned = kernels.AUTOTUNED[name]
        for variant, switches in variants(name).items():
            for head_dim in args.head_dims:
                for causal in causal_values:
                    survivors = kept(autotuned, head_dim, args.capability)
                    # the kernel's own tilings, and the smaller ones kept in their place
                    offered = [*autotuned.configs]
                    offered += [config for config in survivors if config not in offered]
                    for config in survivors if args.kept_only else offered:
                        label = kernels.describe_config(config)
                        label += "" if config in survivors else " (pruned)"
                        compile_one = partial(
                            compile_config,
                            autotuned.fn,
                            config,
                            head_dim,
                            causal,
                            args.capability,
                            **switches,
                        )
                        report(variant, compile_one, label, head_dim, causal)


def report(name: str, compile_one: Callable, label: str, head_dim: int, causal: bool) -> None:
    """Compile one configuration and print its row (or why it failed)."""
    started = time.perf_counter()
    try:
        compiled = compile_one()
    except Exception as error:  # report the failure, go on with the rest
        message = (str(error).splitlines() or [type(error).__name__])[0][:80]
        print(f"| {name} | {head_dim} | {causal} | {label} | failed: {message} |")
        return
    seconds = time.perf_counter() - started
    facts = read_cubin(compiled.asm["cubin"])
    row = [name, head_dim, causal, label, facts["loop"], facts["registers"], facts["stack"]]
    row += [compiled.metadata.shared // 1024, facts["hgmma"], facts["tma_loads"]]
    row += [facts["reductions"], facts["exp2"], f"{seconds:.1f}"]
    print("| " + " | ".join(str(cell) for cell in row) + " |", flush=True)


if __name__ == "__main__":
    main()
