"""Convert a local copy of GSM8K into the conversational layout raygrpo (and TRL / verl) read.

GSM8K comes as rows of `question` and `answer`, the answer a worked solution ending in
"#### <number>": HF's `openai/gsm8k` ("main" config) as parquet files
(main/train-00000-of-00001.parquet, main/test-00000-of-00001.parquet), the original
repository as JSONL (grade_school_math/data/train.jsonl, test.jsonl). This machine cannot
download it; fetch it where you can, e.g.

    huggingface-cli download openai/gsm8k --repo-type dataset --local-dir data/gsm8k-raw

then convert each split (the output format follows the suffix: .jsonl or .parquet):

    python examples/convert_gsm8k.py data/gsm8k-raw/main/train-00000-of-00001.parquet data/gsm8k/train.parquet
    python examples/convert_gsm8k.py data/gsm8k-raw/main/test-00000-of-00001.parquet data/gsm8k/test.parquet

Each output row is {"prompt": [{"role": "user", "content": question + INSTRUCTION}], "answer": ...}
with the answer kept whole: the `gsm8k` reward compares the number after the completion's last
"####" with the one after the answer's. Add a system message with data.system_prompt if the
model wants one.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cluster.data.files import raise_problems, read_rows

INSTRUCTION = ' Let\'s think step by step and output the final answer after "####".'


def convert_rows(rows: list[dict], question_key: str = "question", answer_key: str = "answer") -> list[dict]:
    out = []
    for i, row in enumerate(rows):
        if not isinstance(row.get(question_key), str) or "####" not in str(row.get(answer_key, "")):
            raise ValueError(f"row {i} is not GSM8K-shaped (needs {question_key!r} and an {answer_key!r} with '####'): "
                             f"{json.dumps(row)[:120]}")
        out.append({"prompt": [{"role": "user", "content": row[question_key].strip() + INSTRUCTION}],
                    "answer": row[answer_key]})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Convert GSM8K (question/answer rows) to conversational JSONL or parquet.")
    p.add_argument("src", help="a local GSM8K split: .parquet, .jsonl/.json, or a save_to_disk directory")
    p.add_argument("dst", help="output file, .jsonl or .parquet")
    p.add_argument("--question-key", default="question")
    p.add_argument("--answer-key", default="answer")
    args = p.parse_args(argv)

    problems: list[str] = []
    try:
        rows = [row for _, row in read_rows(args.src, "train", problems)]
        raise_problems(problems, f"cannot read {args.src}")
        converted = convert_rows(rows, args.question_key, args.answer_key)
    except ValueError as e:  # DataError included
        print(f"error: {e}", file=sys.stderr)
        return 2
    dst = Path(args.dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    if dst.suffix == ".parquet":
        import datasets

        datasets.Dataset.from_list(converted).to_parquet(str(dst))
    elif dst.suffix == ".jsonl":
        with open(dst, "w", encoding="utf-8") as f:
            for row in converted:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    else:
        print(f"error: {dst} must end in .jsonl or .parquet", file=sys.stderr)
        return 2
    print(f"{len(converted)} rows -> {dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
