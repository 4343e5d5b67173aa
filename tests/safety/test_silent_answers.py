"""Issue 18, item 7: inputs that used to give a silent wrong answer are refused with a
line that names the input and the fix (exit 2, no traceback). Each case is the probe's
own input."""

from __future__ import annotations

import pytest

from oomless.cli import main

TEXT_MODEL = "qwen2.5-0.5b"


@pytest.mark.parametrize(("argv", "needle"), [
    # quantization was dropped: a full fine-tune answered as if --quant was not given
    (["estimate", TEXT_MODEL, "--method", "full", "--quant", "nf4", "--gpu", "4090"],
     "--quant nf4 quantizes the frozen base of a QLoRA run; the method is full"),
    (["estimate", TEXT_MODEL, "--quant", "int8", "--gpu", "4090"],  # the default method: lora
     "the method is lora, whose base is not quantized: add --method qlora"),
    # images on a text model were accepted and ignored
    (["estimate", TEXT_MODEL, "--images", "5", "--gpu", "4090"],
     "is a text model (no vision tower) and cannot take images"),
    (["plan", TEXT_MODEL, "--images", "5", "--gpu", "4090"],
     "--images 5: qwen2.5-0.5b-instruct is a text model"),
    # an empty GPU was read as "no GPU given"
    (["estimate", TEXT_MODEL, "--gpu", ""], "argument --gpu: empty; give a GPU"),
    (["plan", TEXT_MODEL, "--gpu", " "], "argument --gpu: empty; give a GPU"),
    (["check", "{yaml}", "--gpu", ""], "argument --gpu: empty; give a GPU"),
    # an empty output folder was read as "do not write" (plan) or a default place (report)
    (["plan", TEXT_MODEL, "--gpu", "4090", "--out", ""], "argument --out: empty; give a folder"),
    (["report", "{yaml}", "--out", ""], "argument --out/-o: empty; give a file"),
    (["check", "{yaml}", "--gpu", "4090", "--diff-out", ""], "argument --diff-out: empty"),
])
def test_a_silent_wrong_answer_is_now_a_clear_error(tmp_path, capsys, argv, needle):
    yaml = tmp_path / "run.yaml"
    yaml.write_text(f"model: {TEXT_MODEL}\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main([a.format(yaml=yaml) for a in argv]) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written


def test_a_yaml_with_images_on_a_text_model_is_refused(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {TEXT_MODEL}\ndata:\n  images_per_sample: 2\n")
    assert main(["estimate", str(path), "--gpu", "4090"]) == 2
    assert "data.images_per_sample 2 (--images)" in capsys.readouterr().err


def test_quant_with_qlora_still_works(capsys):
    assert main(["estimate", TEXT_MODEL, "--method", "qlora", "--quant", "int8",
                 "--gpu", "4090", "--json"]) == 0
    assert '"bits": 8' in capsys.readouterr().out


def test_a_duplicate_yaml_key_is_refused(tmp_path, capsys):
    """The probe's silent last-value-wins (tests/safety/test_check_write_files.py covers
    every command)."""
    path = tmp_path / "run.yaml"
    path.write_text(f"model: {TEXT_MODEL}\nseq_len: 512\nseq_len: 4096\n")
    assert main(["estimate", str(path), "--gpu", "4090"]) == 2
    assert "key 'seq_len' appears twice (first on line 2)" in capsys.readouterr().err


def test_an_empty_gpu_from_the_library_path_is_refused_too():
    """The web page builds the options without argparse: an empty GPU is not "no GPU"."""
    import argparse

    from oomless.cli._options import _FLAG_KEYS, run_config_from_args
    from oomless.errors import OomlessError

    args = argparse.Namespace(model=TEXT_MODEL, lora_targets=None, quant=None, gpu="",
                              **{f: None for f in _FLAG_KEYS})
    with pytest.raises(OomlessError, match="empty GPU name"):
        run_config_from_args(args)
