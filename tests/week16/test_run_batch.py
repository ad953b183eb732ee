"""Week 16: `nanoserve run-batch`, offline inference from a batch file through the server's own code.

Greedy answers are compared with `LLM.generate` on the same prompt ids, refused bodies with the
server's own validation, and an interrupted real process with an uninterrupted run.
"""

import csv
import json
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

import nanoserve
from nanoserve.server.run_batch import run_batch
from nanoserve.engine.engine import LLM
from nanoserve.engine.config import EngineConfig
from nanoserve.sampling.params import SamplingParams
from nanoserve.server.protocol import APIError, sampling_params_from

PROMPTS = ["The list", "A dictionary", "def f(x):", "Return the", "import os", "class"]
CHATS = [[{"role": "user", "content": "hi"}],
         [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a tuple?"}]]


@pytest.fixture(scope="module")
def llm():
    return LLM(EngineConfig(model="tiny", dtype=torch.float32, device="cpu", max_model_len=256, num_blocks=512))


def greedy(llm, prompt_ids: list[list[int]], max_tokens: int) -> list:
    return llm.generate(prompt_ids, SamplingParams(temperature=0, max_tokens=max_tokens))


def write_jsonl(path: Path, lines: list) -> Path:
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def read_records(path: Path) -> dict[str, list[dict]]:
    """custom_id -> its records (every line of OUTPUT must be a whole JSON record)."""
    records: dict[str, list[dict]] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        assert record["id"].startswith("batch_req_")
        records.setdefault(record["custom_id"], []).append(record)
    return records


def batch_line(custom_id: str, url: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def answer_text(record: dict) -> str:
    choice = record["response"]["body"]["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_completion_and_chat_lines_equal_greedy_generation(llm, tmp_path):
    lines = [batch_line(f"c{i}", "/v1/completions", prompt=p, max_tokens=4 + i, temperature=0)
             for i, p in enumerate(PROMPTS)]
    lines += [batch_line(f"chat{i}", "/v1/chat/completions", messages=m, max_tokens=7, temperature=0)
              for i, m in enumerate(CHATS)]
    out = tmp_path / "out.jsonl"
    summary = run_batch(llm.engine, write_jsonl(tmp_path / "in.jsonl", lines), out, max_concurrency=3, progress=False)

    assert summary["done"] == len(lines) and summary["errors"] == summary["skipped"] == 0
    assert not summary["interrupted"]
    assert not [t for t in threading.enumerate() if t.name == "nanoserve-engine"]  # shut down
    records = read_records(out)
    assert sorted(records) == sorted(line["custom_id"] for line in lines)
    assert all(len(r) == 1 for r in records.values())

    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    expected = {f"c{i}": greedy(llm, [ids], 4 + i)[0] for i, ids in enumerate(prompt_ids)}
    chat_ids = [llm.tokenizer.apply_chat_template(m) for m in CHATS]
    expected |= {f"chat{i}": o for i, o in enumerate(greedy(llm, chat_ids, 7))}
    for custom_id, (record,) in records.items():
        response, want = record["response"], expected[custom_id]
        assert record["error"] is None and response["status_code"] == 200
        assert response["request_id"] == response["body"]["id"]
        assert response["body"]["model"] == "tiny"  # filled in: the lines gave no model
        assert response["body"]["object"] == ("chat.completion" if custom_id.startswith("chat") else "text_completion")
        assert answer_text(record) == want.text
        assert response["body"]["usage"] == {"prompt_tokens": len(want.prompt_token_ids),
                                             "completion_tokens": len(want.token_ids),
                                             "total_tokens": len(want.prompt_token_ids) + len(want.token_ids)}
    assert summary["output_tokens"] == sum(len(want.token_ids) for want in expected.values())


def test_malformed_lines_get_error_records_and_the_good_lines_still_run(llm, tmp_path):
    good = batch_line("good", "/v1/completions", prompt="The list", max_tokens=3)
    lines = [
        good,                                                                     # 1
        "{not json",                                                              # 2
        "[1, 2]",                                                                 # 3
        {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},    # 4: no custom_id
        {"custom_id": "no-url", "method": "POST", "body": {"prompt": "x"}},       # 5
        {"custom_id": "no-body", "method": "POST", "url": "/v1/completions"},     # 6
        {**batch_line("get", "/v1/completions", prompt="x"), "method": "GET"},    # 7
        batch_line("embed", "/v1/embeddings", input="x"),                         # 8
        batch_line("good", "/v1/completions", prompt="A dictionary"),             # 9: duplicate
        batch_line("streamed", "/v1/completions", prompt="x", stream=True),       # 10
        batch_line("good2", "/v1/chat/completions", messages=CHATS[0], max_tokens=3),  # 11
    ]
    out = tmp_path / "out.jsonl"
    summary = run_batch(llm.engine, write_jsonl(tmp_path / "in.jsonl", lines), out, progress=False)

    records = read_records(out)
    assert sum(len(r) for r in records.values()) == len(lines)
    assert summary["done"] == 2 and summary["errors"] == len(lines) - 2
    expected_errors = {  # custom_id -> (line, code, a word of the message)
        "line-2": (2, "invalid_request", "JSON"), "line-3": (3, "invalid_request", "object"),
        "line-4": (4, "invalid_request", "custom_id"), "no-url": (5, "invalid_request", "url"),
        "no-body": (6, "invalid_request", "body"), "get": (7, "invalid_request", "method"),
        "embed": (8, "invalid_request", "url"), "streamed": (10, "invalid_request", "stream"),
    }
    for custom_id, (line, code, word) in expected_errors.items():
        (record,) = records[custom_id]
        assert record["response"] is None
        assert record["error"]["code"] == code
        assert record["error"]["message"].startswith(f"line {line}: ") and word in record["error"]["message"]
    first, duplicate = sorted(records["good"], key=lambda r: r["error"] is not None)
    assert first["response"]["status_code"] == 200 and first["error"] is None
    assert duplicate["response"] is None and duplicate["error"]["code"] == "duplicate_custom_id"
    assert duplicate["error"]["message"].startswith("line 9: ") and "line 1" in duplicate["error"]["message"]
    assert records["good2"][0]["response"]["status_code"] == 200


def test_a_body_the_server_refuses_gets_the_servers_400(llm, tmp_path):
    bad = dict(prompt="The list", temperature=7)
    lines = [batch_line("hot", "/v1/completions", **bad),
             batch_line("other-model", "/v1/completions", prompt="x", model="gpt-4"),
             batch_line("ok", "/v1/completions", prompt="The list", max_tokens=2)]
    out = tmp_path / "out.jsonl"
    run_batch(llm.engine, write_jsonl(tmp_path / "in.jsonl", lines), out, progress=False)
    records = read_records(out)

    with pytest.raises(APIError) as refused:  # what the server's own validation says
        sampling_params_from(bad, 16)
    (hot,) = records["hot"]
    assert hot["error"] is None and hot["response"]["status_code"] == 400
    assert hot["response"]["body"]["error"]["message"] == refused.value.message
    assert hot["response"]["body"]["error"]["param"] == "temperature"
    (other,) = records["other-model"]
    assert other["response"]["status_code"] == 404
    assert other["response"]["body"]["error"]["code"] == "model_not_found"
    assert records["ok"][0]["response"]["status_code"] == 200


def test_plain_prompt_jsonl_and_csv(llm, tmp_path):
    defaults = dict(max_tokens=5, temperature=0.0)
    jsonl = write_jsonl(tmp_path / "prompts.jsonl", [
        {"prompt": PROMPTS[0], "id": "first"},
        {"prompt": PROMPTS[1]},                                   # line-2
        {"prompt": PROMPTS[2], "custom_id": "third", "max_tokens": 9},  # its own max_tokens wins
        {"messages": CHATS[0]},                                   # line-4, a chat
    ])
    out = tmp_path / "out.jsonl"
    assert run_batch(llm.engine, jsonl, out, defaults=defaults, progress=False)["done"] == 4
    records = read_records(out)
    ids = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    assert answer_text(records["first"][0]) == greedy(llm, [ids[0]], 5)[0].text
    assert answer_text(records["line-2"][0]) == greedy(llm, [ids[1]], 5)[0].text
    assert answer_text(records["third"][0]) == greedy(llm, [ids[2]], 9)[0].text
    chat = greedy(llm, [llm.tokenizer.apply_chat_template(CHATS[0])], 5)[0]
    assert records["line-4"][0]["response"]["body"]["choices"][0]["message"]["content"] == chat.text

    # CSV: quoting, commas and newlines inside a prompt; an empty id is line-N (the row number).
    rows = [("a", "Hello, world"), ("", 'He said "hi"\nthen left'), ("c", PROMPTS[3])]
    with open(tmp_path / "prompts.csv", "w", newline="") as f:
        csv.writer(f).writerows([("id", "prompt"), *rows])
    out_csv = tmp_path / "out_csv.jsonl"
    assert run_batch(llm.engine, tmp_path / "prompts.csv", out_csv, defaults=defaults, progress=False)["done"] == 3
    records = read_records(out_csv)
    assert sorted(records) == ["a", "c", "line-2"]
    expected = greedy(llm, [llm.tokenizer.encode(p) for _, p in rows], 5)
    for custom_id, want in zip(["a", "line-2", "c"], expected):
        assert answer_text(records[custom_id][0]) == want.text


def test_csv_needs_a_prompt_column(llm, tmp_path):
    (tmp_path / "bad.csv").write_text("id,text\n1,hello\n")
    with pytest.raises(ValueError, match="'prompt' column"):
        run_batch(llm.engine, tmp_path / "bad.csv", tmp_path / "out.jsonl", progress=False)


def test_parquet(llm, tmp_path):
    pa = pytest.importorskip("pyarrow", reason="reading Parquet batch files needs pyarrow: pip install pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": PROMPTS[:2], "id": ["p1", None]}), tmp_path / "in.parquet")
    out = tmp_path / "out.jsonl"
    assert run_batch(llm.engine, tmp_path / "in.parquet", out, defaults=dict(max_tokens=4, temperature=0.0),
                     progress=False)["done"] == 2
    records = read_records(out)
    expected = greedy(llm, [llm.tokenizer.encode(p) for p in PROMPTS[:2]], 4)
    assert answer_text(records["p1"][0]) == expected[0].text
    assert answer_text(records["line-2"][0]) == expected[1].text


def test_parquet_without_pyarrow_says_how_to_install_it(llm, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # makes `import pyarrow...` fail, installed or not
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    (tmp_path / "in.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match="pip install pyarrow"):
        run_batch(llm.engine, tmp_path / "in.parquet", tmp_path / "out.jsonl", progress=False)


@pytest.mark.exercise("resume")
def test_resume_runs_only_the_missing_lines_and_drops_a_partial_last_line(llm, tmp_path):
    lines = [batch_line(f"r{i}", "/v1/completions", prompt=PROMPTS[i % len(PROMPTS)] + f" {i}", max_tokens=4,
                        temperature=0) for i in range(8)]
    lines.append(batch_line("r0", "/v1/completions", prompt="again"))  # a duplicate of line 1
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    full = tmp_path / "full.jsonl"
    run_batch(llm.engine, inp, full, progress=False)
    by_id = read_records(full)

    # A run that was killed: r1, r2 and the duplicate's error written (but not r0 itself), and
    # half of r3's record.
    kept = [by_id["r1"][0], by_id["r2"][0]] + [r for r in by_id["r0"] if r["error"] is not None]
    partial = json.dumps(by_id["r3"][0])
    out = tmp_path / "out.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in kept) + partial[: len(partial) // 2])

    summary = run_batch(llm.engine, inp, out, progress=False)
    assert summary["skipped"] == 3 and summary["done"] == 6 and summary["errors"] == 0
    records = read_records(out)  # parses every line: the partial one is gone
    assert len(out.read_text().splitlines()) == len(lines)
    assert Counter((r["custom_id"], r["error"] is None) for rs in records.values() for r in rs) == \
        Counter((r["custom_id"], r["error"] is None) for rs in by_id.values() for r in rs)
    assert records["r1"][0]["id"] == by_id["r1"][0]["id"]  # kept as it was, not redone
    for custom_id in by_id:
        assert {answer_text(r) for r in records[custom_id] if r["response"]} == \
            {answer_text(r) for r in by_id[custom_id] if r["response"]}


@pytest.mark.exercise("resume")
def test_interrupt_and_resume_in_a_real_process(llm, tmp_path):
    # The first lines are short, the rest long: records appear at once, then the run takes a while.
    lines = [batch_line(f"r{i:02d}", "/v1/completions", prompt=f"Example {i}: the", temperature=0,
                        ignore_eos=True, max_tokens=2 if i < 4 else 48) for i in range(40)]
    inp = write_jsonl(tmp_path / "in.jsonl", lines)
    out = tmp_path / "out.jsonl"
    command = [sys.executable, "-m", "nanoserve.cli", "run-batch", str(inp), str(out), "--device", "cpu",
               "--dtype", "float32", "--max-model-len", "256", "--num-blocks", "512", "--max-concurrency", "4"]
    repo = Path(nanoserve.__file__).resolve().parent.parent  # the same package in the child process

    child = subprocess.Popen(command, cwd=repo, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (out.exists() and len(out.read_text().splitlines()) >= 3):
        assert child.poll() is None and time.time() < deadline, child.communicate()
        time.sleep(0.01)
    child.send_signal(signal.SIGINT)
    _, stderr = child.communicate(timeout=60)
    assert child.returncode == 130, stderr
    written = len(out.read_text().splitlines())
    assert 3 <= written < len(lines)
    assert f"interrupted: {written} of {len(lines)} done; run the same command again to resume" in stderr

    again = subprocess.run(command, cwd=repo, capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert f"skipped as already in {out}" in again.stderr
    records = read_records(out)
    assert sorted(records) == sorted(line["custom_id"] for line in lines)
    assert all(len(r) == 1 and r[0]["response"]["status_code"] == 200 for r in records.values())

    uninterrupted = tmp_path / "uninterrupted.jsonl"
    run_batch(llm.engine, inp, uninterrupted, progress=False)
    expected = read_records(uninterrupted)
    assert {k: answer_text(r[0]) for k, r in records.items()} == {k: answer_text(r[0]) for k, r in expected.items()}
