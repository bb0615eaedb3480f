"""Triton kernels compiled ahead of time for TensorRT: PTX for one GPU architecture, with the launch ABI
TensorRT's AOT plugins use (tensor inputs, then int32 scalars, then tensor outputs)."""

import re

import torch

TRITON_TYPES = {
    torch.float32: "fp32",
    torch.float16: "fp16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "i1",
}
SHARED_LIMIT = 48 * 1024  # bytes of static shared memory a kernel may use without an opt-in launch attribute


def next_pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << max(0, int(n) - 1).bit_length())


def strip_hidden_params(ptx: str, name: str, n_args: int) -> str:
    """Triton appends hidden pointer parameters (global and profile scratch) after the kernel's own; a TensorRT
    AOT launch passes only the kernel's own. With no scratch the hidden ones are never read, so drop them
    from the entry's declaration; ValueError if one of them is read."""
    head = re.search(rf"\.entry\s+{re.escape(name)}\s*\(", ptx)
    if head is None:
        raise ValueError(f"PTX has no entry {name}")
    end = ptx.index(")", head.end())
    params = [p.strip() for p in ptx[head.end() : end].split(",") if p.strip()]
    if len(params) < n_args:
        raise ValueError(f"entry {name} declares {len(params)} parameters, the kernel has {n_args}")
    body = ptx[end:]
    for p in params[n_args:]:
        pname = p.split()[-1]
        if re.search(rf"\b{re.escape(pname)}\b", body):
            raise ValueError(f"entry {name} reads its hidden parameter {pname}; it cannot be launched by TensorRT")
    kept = ",\n\t".join(params[:n_args])
    return f"{ptx[: head.end()]}\n\t{kept}\n{ptx[end:]}"


def compile_kernel(
    fn,
    signature: dict[str, str],
    constexprs: dict,
    num_warps: int,
    num_stages: int,
    compute_capability: str,
    attrs: dict | None = None,
):
    """Triton's compiled kernel of `fn` for sm<cc>, on any machine (no GPU needed): `signature` types every
    parameter ("constexpr" for those in `constexprs`), `attrs` maps a parameter's (index,) to its specializations
    (e.g. [["tt.divisibility", 16]])."""
    import triton
    from triton.backends.compiler import GPUTarget

    major, minor = (int(x) for x in compute_capability.split("."))
    src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(
        src,
        target=GPUTarget("cuda", major * 10 + minor, 32),
        options={"num_warps": num_warps, "num_stages": num_stages},
    )


def compile_ptx(
    fn, signature: dict[str, str], constexprs: dict, num_warps: int, num_stages: int, compute_capability: str
) -> tuple[str, str, int]:
    """(kernel name, PTX with the TensorRT launch ABI, static shared memory bytes) of `fn` for sm<cc>."""
    full = {**signature, **{k: "constexpr" for k in constexprs}}
    kernel = compile_kernel(fn, full, constexprs, num_warps, num_stages, compute_capability)
    meta = kernel.metadata
    if getattr(meta, "global_scratch_size", 0) or getattr(meta, "profile_scratch_size", 0):
        raise ValueError(f"{meta.name}: needs Triton scratch memory, which a TensorRT AOT launch cannot provide")
    if meta.shared > SHARED_LIMIT:
        raise ValueError(
            f"{meta.name}: {meta.shared} bytes of shared memory, over the {SHARED_LIMIT} a TensorRT AOT launch allows"
        )
    return meta.name, strip_hidden_params(kernel.asm["ptx"], meta.name, len(signature)), meta.shared
