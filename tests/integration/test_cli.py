"""The command line on a real root: latest, ls, show, export-hf and --version, with exit codes."""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest
import torch

import ckptd
from ckptd.cli import main
from ckptd.workers import save_hf_model

CONFIG = {"model_type": "llama", "vocab_size": 32, "hidden_size": 8, "intermediate_size": 16,
          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
          "max_position_embeddings": 16, "tie_word_embeddings": False}


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture
def root(make_monitor, tmp_path, run_name):
    """Step 1 a full checkpoint (HF weights), step 2 a state dict; one read lease on step 2."""
    from transformers import LlamaConfig, LlamaForCausalLM

    root = str(tmp_path / "ckpt")
    monitor = make_monitor(root)
    coord = ckptd.CheckpointCoordinator(monitor, worker_id="w")
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG))
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    for step, state_dict in ((1, False), (2, True)):
        out = coord.step_dir(step)
        coord.save_async("hf", lambda out=out: save_hf_model(out, sd, CONFIG), step, is_state_dict=state_dict)
        coord.register(step, is_state_dict=state_dict, **({"state_dict_thread_count": 1} if state_dict
                                                         else {"checkpoint_thread_count": 1}))
        coord.wait_committed(step, is_state_dict=state_dict, timeout_s=30)
    sub = ckptd.WeightSubscriber(run_name)
    weights = sub.open(2)
    yield root, model
    weights.release()
    sub.close()
    coord.close()


def test_ls_show_latest_and_export_read_a_root(root, tmp_path, capsys):
    root, model = root
    code, out, _ = run_cli(capsys, "latest", root, "--json")
    assert code == 0 and json.loads(out) == {"checkpoint": 1, "state_dict": 2}

    code, out, _ = run_cli(capsys, "ls", root, "--json")
    rows = {r["step"]: r for r in json.loads(out)}
    assert code == 0 and sorted(rows) == [1, 2]
    assert rows[1]["kinds"] == ["checkpoint"] and rows[2]["kinds"] == ["state_dict"]
    assert rows[2]["pinned"] and not rows[1]["pinned"] and rows[1]["mirrored"] is None
    assert rows[1]["files"] == 2 and rows[1]["bytes"] > 4 * sum(v.numel() for v in model.state_dict().values())
    code, out, _ = run_cli(capsys, "ls", root)
    assert code == 0 and "checkpoint" in out and "state_dict" in out

    code, out, _ = run_cli(capsys, "show", root, "1", "--json")
    manifest = json.loads(out)["checkpoint"]
    assert code == 0 and {f["path"] for f in manifest["files"]} == {"config.json", "model.safetensors"}
    code, out, _ = run_cli(capsys, "show", root, "1")  # the commit's time in UTC, as people read it
    when = datetime.fromtimestamp(manifest["committed_at"], timezone.utc)
    assert code == 0 and f"checkpoint: committed {when:%Y-%m-%d %H:%M:%S}." in out and " UTC by attempt " in out
    code, _, err = run_cli(capsys, "show", root, "7")
    assert code == 1 and "step 7 is not committed" in err

    from transformers import AutoModelForCausalLM

    out_dir = str(tmp_path / "hf")
    code, out, _ = run_cli(capsys, "export-hf", root, "1", out_dir)  # the step's own config.json
    assert code == 0 and "wrote 2 files" in out
    exported = AutoModelForCausalLM.from_pretrained(out_dir)
    ids = torch.arange(8).reshape(1, 8)
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits, model(input_ids=ids).logits)


def test_an_empty_root_exits_1_and_version_prints_the_package_version(tmp_path, capsys):
    code, out, err = run_cli(capsys, "latest", str(tmp_path / "nowhere"))
    assert code == 1 and "checkpoint: -" in out and "nothing is committed" in err
    code, _, err = run_cli(capsys, "ls", str(tmp_path / "nowhere"))
    assert code == 1 and "nothing is committed" in err
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    # (Ray may print a line of its own into the captured output.)
    assert e.value.code == 0 and f"ckptd {ckptd.__version__}" in capsys.readouterr().out.splitlines()
