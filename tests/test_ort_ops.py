"""dtrt's ONNX Runtime kernel library (dtrt.runtime.backends.ort_ops): it builds from its own sources alone, and
the C ABI it declares (ort_abi.h) is ONNX Runtime's."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dtrt.runtime.backends import ort_ops

# OrtApi entries by ort_abi.h's name -> the C API's
ENTRIES = {
    "kCreateStatus": "CreateStatus",
    "kCreateCustomOpDomain": "CreateCustomOpDomain",
    "kCustomOpDomainAdd": "CustomOpDomain_Add",
    "kAddCustomOpDomain": "AddCustomOpDomain",
    "kGetTensorMutableData": "GetTensorMutableData",
    "kGetDimensionsCount": "GetDimensionsCount",
    "kGetDimensions": "GetDimensions",
    "kGetTensorTypeAndShape": "GetTensorTypeAndShape",
    "kKernelContextGetInput": "KernelContext_GetInput",
    "kKernelInfoGetAttributeInt64": "KernelInfoGetAttribute_int64",
    "kKernelContextGetOutput": "KernelContext_GetOutput",
    "kReleaseStatus": "ReleaseStatus",
    "kReleaseTensorTypeAndShapeInfo": "ReleaseTensorTypeAndShapeInfo",
    "kKernelContextParallelFor": "KernelContext_ParallelFor",
}
FIELDS = """version CreateKernel GetName GetExecutionProviderType GetInputType GetInputTypeCount GetOutputType
    GetOutputTypeCount KernelCompute KernelDestroy GetInputCharacteristic GetOutputCharacteristic GetInputMemoryType
    GetVariadicInputMinArity GetVariadicInputHomogeneity GetVariadicOutputMinArity GetVariadicOutputHomogeneity
    CreateKernelV2 KernelComputeV2 InferOutputShapeFn GetStartVersion GetEndVersion GetMayInplace ReleaseMayInplace
    GetAliasMap ReleaseAliasMap""".split()
VALUES = {  # ort_abi.h's name -> the C API's, and the value both give it
    "dtrt_ort::kFloat": ("ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT", 1),
    "dtrt_ort::kUInt8": ("ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8", 2),
    "dtrt_ort::kInt64": ("ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64", 7),
    "dtrt_ort::kBool": ("ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL", 9),
    "dtrt_ort::kInvalidArgument": ("ORT_INVALID_ARGUMENT", 2),
    "dtrt_ort::kRequired": ("INPUT_OUTPUT_REQUIRED", 0),
    "dtrt_ort::kMemDefault": ("OrtMemTypeDefault", 0),
}


def abi_check() -> str:
    """A translation unit that compiles only if every declaration of ort_abi.h matches ONNX Runtime's header."""
    lines = ["#include <cstddef>", "#include <onnxruntime_c_api.h>", '#include "ort_abi.h"']
    lines.append("static_assert(ORT_API_VERSION >= dtrt_ort::kApiVersion);")
    for ours, theirs in ENTRIES.items():
        lines.append(f'static_assert(offsetof(OrtApi, {theirs}) == sizeof(void*) * dtrt_ort::{ours}, "{theirs}");')
    for f in FIELDS:
        lines.append(f'static_assert(offsetof(OrtCustomOp, {f}) == offsetof(dtrt_ort::CustomOp, {f}), "{f}");')
    lines.append("static_assert(sizeof(OrtCustomOp) == sizeof(dtrt_ort::CustomOp));")
    lines.append("static_assert(offsetof(OrtApiBase, GetApi) == offsetof(dtrt_ort::ApiBase, GetApi));")
    lines.append("static_assert(sizeof(OrtApiBase) == sizeof(dtrt_ort::ApiBase));")
    lines += [f'static_assert((int){theirs} == (int){ours}, "{theirs}");' for ours, (theirs, _) in VALUES.items()]
    return "\n".join(lines) + "\n"


def test_the_declared_abi_is_onnxruntimes(tmp_path):
    """Every OrtApi entry, OrtCustomOp field and enum value ort_abi.h declares sits where ONNX Runtime's own header
    puts it (its C API header: DTRT_ORT_INCLUDE, else /usr/include/onnxruntime)."""
    inc = next(
        (
            Path(d)
            for d in (os.environ.get("DTRT_ORT_INCLUDE"), "/usr/include/onnxruntime")
            if d and (Path(d) / "onnxruntime_c_api.h").is_file()
        ),
        None,
    )
    if inc is None or shutil.which("c++") is None:
        pytest.skip("needs ONNX Runtime's C API header (DTRT_ORT_INCLUDE) and a C++ compiler")
    src = tmp_path / "abi_check.cc"
    src.write_text(abi_check())
    cmd = ["c++", "-std=c++17", "-fsyntax-only", f"-I{inc}", f"-I{ort_ops.ABI.parent}", str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def fake_header(shift: int) -> str:
    """A stand-in for ONNX Runtime's header with ort_abi.h's values, its OrtApi entries `shift` places later."""
    from_abi = dict(line.split(" = ") for line in _abi_enum_lines())
    places = {int(from_abi[ours].rstrip(",")) + shift: theirs for ours, theirs in ENTRIES.items()}
    api = [f"void* {places.get(i, f'unused{i}')};" for i in range(max(places) + 1)]
    op = ["uint32_t version;"] + [f"void* {f};" for f in FIELDS[1:]]
    values = dict(VALUES.values())
    return (
        "\n".join(
            [
                "#include <cstdint>",
                "#define ORT_API_VERSION 21",
                "struct OrtApi {",
                *api,
                "};",
                "struct OrtCustomOp {",
                *op,
                "};",
                "struct OrtApiBase { void* GetApi; void* GetVersionString; };",
                "enum {",
                *(f"{k} = {v}," for k, v in values.items()),
                "};",
            ]
        )
        + "\n"
    )


def _abi_enum_lines() -> list[str]:
    text = ort_ops.ABI.read_text()
    body = text[text.index("enum Entry") :].split("{", 1)[1].split("}", 1)[0]
    return [x.strip() for x in body.splitlines() if " = " in x]


@pytest.mark.parametrize("shift", [0, 1])
def test_the_check_fails_on_a_misplaced_entry(tmp_path, shift):
    """The ABI check passes on a header that agrees with ort_abi.h and fails on one whose entries sit one place
    later (so its passing on ONNX Runtime's header means something)."""
    if shutil.which("c++") is None:
        pytest.skip("needs a C++ compiler")
    (tmp_path / "onnxruntime_c_api.h").write_text(fake_header(shift))
    src = tmp_path / "abi_check.cc"
    src.write_text(abi_check())
    cmd = ["c++", "-std=c++17", "-fsyntax-only", f"-I{tmp_path}", f"-I{ort_ops.ABI.parent}", str(src)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if shift:
        assert done.returncode != 0 and "CreateStatus" in done.stderr
    else:
        assert done.returncode == 0, done.stderr


def test_the_kernel_builds_wherever_it_can_run():
    """Where nothing the kernel needs is missing (a C++ compiler, AVX2 and FMA, ONNX Runtime 1.21 on), it builds
    from its own sources: no ONNX Runtime headers."""
    if ort_ops.status():
        pytest.skip(f"dtrt's ONNX Runtime kernel: {ort_ops.status()}")
    assert ort_ops.library() is not None


def test_a_build_in_the_background_is_the_one_library_waits_for(tmp_path, monkeypatch):
    """A first use starts the compile on its own thread while the export runs; the session's library() then waits
    for that build and gets its file: one compile, not a second one beside it."""
    import threading
    import time

    if ort_ops.status():
        pytest.skip(f"dtrt's ONNX Runtime kernel: {ort_ops.status()}")
    monkeypatch.setenv("DTRT_CACHE", str(tmp_path))
    compiles = []

    def compile_slowly(cmd, **kwargs):  # the compiler's command, made to take a while and write its output
        compiles.append(threading.current_thread().name)
        time.sleep(0.5)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"built")
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(ort_ops.subprocess, "run", compile_slowly)
    ort_ops._built.cache_clear()
    try:
        ort_ops.build_in_background()
        time.sleep(0.1)  # the build has begun on its thread
        lib = ort_ops.library()
        assert compiles == ["dtrt-ort-ops-build"]
        assert lib is not None and lib.read_bytes() == b"built" and lib.is_relative_to(tmp_path)
        assert [p.name for p in lib.parent.iterdir()] == [lib.name]  # its scratch folder is gone
    finally:
        ort_ops._built.cache_clear()
    monkeypatch.setenv("DTRT_ORT_OPS", "0")
    ort_ops.build_in_background()  # where the kernels are off nothing is compiled
    assert not any(t.name == "dtrt-ort-ops-build" for t in threading.enumerate()) and len(compiles) == 1
