"""The example configs load, and the GSM8K converter turns GSM8K's layout into rows gsm8k can score."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from actors.rewards.functions import gsm8k
from cluster.config import load_config
from cluster.data.dataset import load_examples

ROOT = Path(__file__).resolve().parents[2]
GSM8K_ROWS = [  # GSM8K's own layout (question, answer with a worked solution ending in "#### N")
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips altogether "
               "in April and May.\n#### 72"},
    {"question": "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total?",
     "answer": "It takes 2/2=<<2/2=1>>1 bolt of white fiber\nSo the total is 2+1=<<2+1=3>>3 bolts\n#### 3"},
]


@pytest.mark.parametrize("name", sorted(p.name for p in (ROOT / "examples").glob("*.yaml")))
def test_example_configs_are_valid(name):
    load_config(ROOT / "examples" / name, validate_paths=False)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_convert_gsm8k(tmp_path, suffix):
    import datasets

    raw = tmp_path / "train-00000-of-00001.parquet"
    datasets.Dataset.from_list(GSM8K_ROWS).to_parquet(str(raw))
    out = tmp_path / f"train{suffix}"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "convert_gsm8k.py"), str(raw), str(out)],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    examples = load_examples(str(out))
    assert len(examples) == 2
    assert examples[0].prompt[0]["role"] == "user" and examples[0].prompt[0]["content"].startswith("Natalia sold")
    assert gsm8k(examples[0].prompt, "48 + 24 = 72\n#### 72", **examples[0].fields) == 1.0
    assert gsm8k(examples[1].prompt, "#### 4", **examples[1].fields) == 0.0


def test_convert_gsm8k_refuses_other_layouts(tmp_path):
    raw = tmp_path / "x.jsonl"
    raw.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "convert_gsm8k.py"), str(raw), str(tmp_path / "o.jsonl")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 2 and "not GSM8K-shaped" in done.stderr and "Traceback" not in done.stderr
