"""docs/config-fields.md is generated from the config models: it must list every field as the models define it today."""
from pathlib import Path

from spillover.infra.config.run_config import RunConfig
from spillover.infra.config.reference import render_reference

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config-fields.md"


def test_the_committed_reference_is_current():
    assert PAGE.read_text() == render_reference(), (
        "docs/config-fields.md is out of date: run `python -m spillover.infra.config.reference > docs/config-fields.md`")


def test_every_field_is_listed_with_its_default():
    page = render_reference()
    assert f"| `rollout.max_split` | int | `{RunConfig().rollout.max_split}` |" in page
    for name, field in RunConfig.model_fields["rollout"].annotation.model_fields.items():
        assert f"`rollout.{name}`" in page
    assert f"| `optimizer.lr` | float | `{RunConfig().optimizer.lr}` |" in page
