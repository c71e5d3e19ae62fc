"""tools/ab_prefill.py's form parsing (CPU): each value takes the type of the ops_cupy attribute it sets, so a
string choice stays a string (MOE_TC == "0" is how ops_cupy reads it) and a bound a float; anything else is
refused with one line before any model is loaded."""
import sys
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
import ab_prefill  # noqa: E402


def test_values_take_the_attributes_types():
    name, sets = ab_prefill.parse_form("rs:MOE_TC=0,MOE_TC_MAX_MEAN=1e9,MOE_TC_T16_MAX=0")
    assert name == "rs"
    assert sets == {"MOE_TC": "0", "MOE_TC_MAX_MEAN": 1e9, "MOE_TC_T16_MAX": 0.0}
    assert type(sets["MOE_TC"]) is str and type(sets["MOE_TC_T16_MAX"]) is float


@pytest.mark.parametrize("bad", ["MOE_TC=0", "rs:", "rs:NO_SUCH_SETTING=1", "rs:MOE_TC_MAX_MEAN=lots",
                                 "rs:MOE_TC", "rs:MOE_RS_FORMS=1"])
def test_malformed_forms_are_refused(bad):
    with pytest.raises(click.BadParameter):
        ab_prefill.parse_form(bad)


def test_a_bad_form_ends_with_one_line_before_loading(tmp_path):
    model = tmp_path / "m.bin"
    model.write_bytes(b"not a model")  # never opened: the forms are read first
    r = CliRunner().invoke(ab_prefill.main, [str(model), "--form", "a:MOE_TC=0", "--form", "b:NOPE=1"])
    assert r.exit_code != 0 and "NOPE=1" in r.output and "Traceback" not in r.output
