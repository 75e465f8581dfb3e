"""Multi-process runs get a collective timeout long enough for the main process's data stage; the run summary's command line."""

from datetime import timedelta

import pytest

from specfoundry.train.launcher import DEFAULT_PG_TIMEOUT_MIN, PG_TIMEOUT_ENV, process_group_kwargs


def test_default_timeout_outlasts_a_long_data_stage_and_cpu_uses_gloo():
    kw = process_group_kwargs({})
    assert kw["timeout"] == timedelta(minutes=DEFAULT_PG_TIMEOUT_MIN) >= timedelta(hours=6)
    assert kw["backend"] == "gloo"  # no CUDA here


def test_timeout_override_and_bad_values():
    assert process_group_kwargs({PG_TIMEOUT_ENV: "90"})["timeout"] == timedelta(minutes=90)
    for bad in ("0", "-5", "soon", "nan", "inf"):
        with pytest.raises(ValueError, match=PG_TIMEOUT_ENV):
            process_group_kwargs({PG_TIMEOUT_ENV: bad})


def test_summary_command_names_train_once():
    from specfoundry.train.run import _command_line

    assert _command_line(["/x/specfoundry", "train", "eagle3-smollm2-135m", "--overwrite"]) == \
        "specfoundry train eagle3-smollm2-135m --overwrite"
    assert _command_line(["/x/specfoundry/train/__main__.py", "eagle3-smollm2-135m"]) == "specfoundry train eagle3-smollm2-135m"
