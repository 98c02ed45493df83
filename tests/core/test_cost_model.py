"""The cost model: shipped profiles, YAML edge (errors name file:line and field), unit checks,
per-instance and per-pair overrides, chunked prefill."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from disagg.core import cost_model as cost_model_mod
from disagg.core.cost_model import (
    PROFILES_DIR,
    CostModel,
    CostModelError,
    EngineConstants,
    TransferConstants,
    load_profile,
)
from disagg.core.types import SloClass
from factories import cost_model_dict, engine_dict, make_cost_model

approx = pytest.approx


# --- shipped profiles ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["a40", "cpu-tiny"])
def test_shipped_profiles_load(name):
    cm = load_profile(name)
    assert isinstance(cm, CostModel)
    assert set(cm.slo) == set(SloClass)
    assert 0 < cm.engine.decode_token_s(1) <= 1.0
    # strict is stricter than loose in every shipped profile
    assert cm.target(SloClass.TIGHT).ttft_s < cm.target(SloClass.LOOSE).ttft_s


def test_a40_profile_matches_the_paper_testbed():
    cm = load_profile("a40")
    assert cm.engine.kv_capacity_tokens == 60_000
    assert cm.target(SloClass.TIGHT).ttft_s == approx(0.175)
    assert cm.target(SloClass.TIGHT).tpot_s == approx(0.0397)
    assert cm.target(SloClass.LOOSE).ttft_s == approx(3 * 0.175)
    assert cm.target(SloClass.LOOSE).tpot_s == approx(3 * 0.0397)


def test_load_profile_accepts_a_path(tmp_path):
    p = tmp_path / "mine.yaml"
    p.write_text(yaml.safe_dump(cost_model_dict(name="mine")))
    assert load_profile(str(p)).name == "mine"
    assert load_profile(p).name == "mine"


def test_load_profile_unknown_name_lists_shipped_profiles():
    with pytest.raises(CostModelError) as e:
        load_profile("h100-nope")
    msg = str(e.value)
    assert "h100-nope" in msg
    shipped = sorted(p.stem for p in PROFILES_DIR.glob("*.yaml"))
    assert {"a40", "cpu-tiny"} <= set(shipped)
    for name in shipped:
        assert name in msg


# --- save / load --------------------------------------------------------------------------------


def _rich_model() -> CostModel:
    return make_cost_model(
        name="rich",
        calibrated=True,
        instances={"d1": engine_dict(step_base_s=0.02, kv_capacity_tokens=20_000)},
        pairs={"p0->d1": {"latency_s": 0.01, "tokens_per_s": 5_000.0}},
    )


@pytest.mark.parametrize("model", [lambda: load_profile("a40"), lambda: load_profile("cpu-tiny"), _rich_model])
def test_round_trip_save_load_is_equal(tmp_path, model):
    cm = model()
    path = tmp_path / "nested" / "dir" / "cm.yaml"
    cm.save(path)
    back = CostModel.load(path)
    assert back == cm
    assert back.to_dict() == cm.to_dict()


def test_save_is_atomic_and_leaves_no_temp_files(tmp_path):
    path = tmp_path / "cm.yaml"
    make_cost_model(name="first").save(path)
    _rich_model().save(path)  # overwrite
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cm.yaml"]
    assert CostModel.load(path).name == "rich"


def test_failed_save_leaves_old_file_and_no_temp_files(tmp_path, monkeypatch):
    path = tmp_path / "cm.yaml"
    make_cost_model(name="first").save(path)
    before = path.read_text()

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(cost_model_mod.yaml, "safe_dump", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        _rich_model().save(path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cm.yaml"]


# --- refusals (from_dict) -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, field, value",
    [
        (cost_model_dict(engine=engine_dict(prefill_token_s=0)), "engine.prefill_token_s", "0"),
        (cost_model_dict(engine=engine_dict(prefill_token_s=-0.001)), "engine.prefill_token_s", "-0.001"),
        # decode time per token at batch 1 above a second: units are wrong
        (cost_model_dict(engine=engine_dict(step_base_s=0.9, decode_seq_s=0.2)), "engine", "1.1"),
        (cost_model_dict(engine=engine_dict(step_base_s=0.0, decode_seq_s=0.0)), "engine", "0.0"),
        (cost_model_dict(engine=engine_dict(kv_capacity_tokens=0)), "engine.kv_capacity_tokens", "0"),
        (cost_model_dict(transfer={"latency_s": 0.001, "tokens_per_s": 0}), "transfer.tokens_per_s", "0"),
        (cost_model_dict(slo={"tight": {"ttft_s": 0.2, "tpot_s": 0.05}}), "slo", "loose"),
        (cost_model_dict(slo={"loose": {"ttft_s": 0.2, "tpot_s": 0.05}}), "slo", "tight"),
        (cost_model_dict(slo={"tight": {"ttft_s": 0.2, "tpot_s": 0.05}, "loose": {"ttft_s": 0.6, "tpot_s": 0.1},
                              "medium": {"ttft_s": 0.3, "tpot_s": 0.1}}), "slo", "medium"),
        (cost_model_dict(engine=engine_dict(prefill_tokens_s=0.001)), "engine.prefill_tokens_s", "0.001"),
        (cost_model_dict(bogus=1), "bogus", "1"),
        (cost_model_dict(pairs={"p0-d1": {"latency_s": 0.0, "tokens_per_s": 1.0}}), "pairs", "p0-d1"),
        (cost_model_dict(instances={"d1": engine_dict(step_base_s=2.0)}), "instances.d1.step_base_s", "2.0"),
    ],
)
def test_refusals_name_field_and_value(data, field, value):
    with pytest.raises(CostModelError) as e:
        CostModel.from_dict(data, Path("cfg.yaml"))
    msg = str(e.value)
    assert f"field '{field}" in msg
    assert value in msg
    assert msg.startswith("cfg.yaml")


def test_refusal_messages_say_what_is_wrong():
    with pytest.raises(CostModelError, match=r"1\.1.*seconds"):
        CostModel.from_dict(cost_model_dict(engine=engine_dict(step_base_s=0.9, decode_seq_s=0.2)))
    with pytest.raises(CostModelError, match="missing SLO targets.*loose"):
        CostModel.from_dict(cost_model_dict(slo={"tight": {"ttft_s": 0.2, "tpot_s": 0.05}}))
    with pytest.raises(CostModelError, match="(?i)extra inputs are not permitted"):
        CostModel.from_dict(cost_model_dict(engine=engine_dict(extra_knob=1)))


def test_boundary_values_are_accepted():
    # exactly 1 s per decode token at batch 1 is still physical
    cm = make_cost_model(engine=engine_dict(step_base_s=0.5, decode_seq_s=0.5))
    assert cm.engine.decode_token_s(1) == approx(1.0)


# --- YAML file errors ---------------------------------------------------------------------------

GOOD_YAML = textwrap.dedent(
    """\
    name: test
    engine:
      step_base_s: 0.01
      prefill_token_s: 0.001
      decode_seq_s: 0.001
      kv_capacity_tokens: 10000
    transfer:
      latency_s: 0.002
      tokens_per_s: 100000
    slo:
      tight: {ttft_s: 0.2, tpot_s: 0.05}
      loose: {ttft_s: 0.6, tpot_s: 0.15}
    """
)


def _write(tmp_path, text, name="cm.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def _line_of(text: str, needle: str) -> int:
    for i, line in enumerate(text.splitlines(), 1):
        if needle in line:
            return i
    raise AssertionError(f"{needle!r} not in the YAML")


def test_good_yaml_loads(tmp_path):
    cm = CostModel.load(_write(tmp_path, GOOD_YAML))
    assert cm.engine.prefill_token_s == 0.001
    assert cm.engine.max_batched_tokens == 2048  # default


@pytest.mark.parametrize(
    "old, new, needle, field, value",
    [
        ("prefill_token_s: 0.001", "prefill_token_s: 0", "prefill_token_s", "engine.prefill_token_s", "0"),
        ("tokens_per_s: 100000", "tokens_per_s: -5", "tokens_per_s", "transfer.tokens_per_s", "-5"),
        ("kv_capacity_tokens: 10000", "kv_capacity_tokens: 10000\n  surprise: 3", "surprise", "engine.surprise", "3"),
        # decode step above a second: the whole `engine` mapping is at fault → the `engine:` line
        ("decode_seq_s: 0.001", "decode_seq_s: 0.999", "engine:", "engine", "1.009"),
        ("  loose: {ttft_s: 0.6, tpot_s: 0.15}\n", "", "slo:", "slo", "loose"),
        ("  tight: {ttft_s: 0.2", "  tight: {ttft_s: 0.0", "tight:", "slo.tight.ttft_s", "0.0"),
        ("name: test\n", "name: test\ncolour: blue\n", "colour", "colour", "blue"),
    ],
)
def test_yaml_errors_name_file_line_and_field(tmp_path, old, new, needle, field, value):
    assert old in GOOD_YAML
    text = GOOD_YAML.replace(old, new)
    path = _write(tmp_path, text)
    with pytest.raises(CostModelError) as e:
        CostModel.load(path)
    msg = str(e.value)
    line = _line_of(text, needle)
    assert f"{path}:{line}: field '{field}'" in msg, msg
    assert value in msg


def test_missing_key_points_at_the_parent_mapping(tmp_path):
    text = GOOD_YAML.replace("  kv_capacity_tokens: 10000\n", "")
    path = _write(tmp_path, text)
    with pytest.raises(CostModelError) as e:
        CostModel.load(path)
    assert f"{path}:{_line_of(text, 'engine:')}: field 'engine.kv_capacity_tokens'" in str(e.value)


def test_several_errors_are_all_reported(tmp_path):
    text = GOOD_YAML.replace("prefill_token_s: 0.001", "prefill_token_s: 0").replace(
        "tokens_per_s: 100000", "tokens_per_s: 0")
    path = _write(tmp_path, text)
    with pytest.raises(CostModelError) as e:
        CostModel.load(path)
    msg = str(e.value)
    assert f"{path}:{_line_of(text, 'prefill_token_s')}: field 'engine.prefill_token_s'" in msg
    assert f"{path}:{_line_of(text, 'tokens_per_s')}: field 'transfer.tokens_per_s'" in msg


def test_invalid_yaml_syntax_names_file_and_line(tmp_path):
    text = GOOD_YAML.replace("decode_seq_s: 0.001", "decode_seq_s: 0.001: 7")
    path = _write(tmp_path, text)
    with pytest.raises(CostModelError) as e:
        CostModel.load(path)
    msg = str(e.value)
    assert f"{path}:{_line_of(text, 'decode_seq_s')}: not valid YAML" in msg


@pytest.mark.parametrize("text, kind", [("- 1\n- 2\n", "list"), ("just a string\n", "str"), ("", "NoneType")])
def test_non_mapping_yaml_is_refused(tmp_path, text, kind):
    path = _write(tmp_path, text)
    with pytest.raises(CostModelError) as e:
        CostModel.load(path)
    msg = str(e.value)
    assert str(path) in msg and "mapping" in msg and kind in msg


def test_missing_file(tmp_path):
    path = tmp_path / "absent.yaml"
    with pytest.raises(CostModelError, match="no such cost-model file") as e:
        CostModel.load(path)
    assert str(path) in str(e.value)


def test_cost_model_error_is_a_value_error():
    assert issubclass(CostModelError, ValueError)


# --- overrides ----------------------------------------------------------------------------------


def test_per_instance_overrides_are_used_by_for_instance():
    cm = make_cost_model(instances={"d1": engine_dict(step_base_s=0.02, kv_capacity_tokens=50_000)})
    assert cm.for_instance("d1").step_base_s == 0.02
    assert cm.for_instance("d1").decode_token_s(1) == approx(0.021)
    assert cm.for_instance("d0") is cm.engine
    assert cm.for_instance("d0").step_base_s == 0.01
    assert cm.max_kv_capacity_tokens == 50_000
    assert make_cost_model().max_kv_capacity_tokens == 10_000


def test_per_pair_overrides_are_used_by_transfer_between():
    cm = make_cost_model(pairs={"p0->d1": {"latency_s": 0.05, "tokens_per_s": 1_000.0}})
    assert cm.transfer_between("p0", "d1") == TransferConstants(latency_s=0.05, tokens_per_s=1_000.0)
    assert cm.transfer_between("d1", "p0") is cm.transfer  # direction matters
    assert cm.transfer_between("p0", "d0") is cm.transfer
    assert cm.transfer_s("p0", "d1", 500) == approx(0.05 + 0.5)
    assert cm.transfer_s("p0", "d0", 500) == approx(0.002 + 500 / 100_000)
    assert cm.transfer_s("d1", "d1", 500) == 0.0  # colocated: no transfer


# --- engine constants ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "prompt, expected",
    [
        (0, 0.0),
        (1, 1 * 0.01 + 0.001),
        (255, 1 * 0.01 + 0.255),
        (256, 1 * 0.01 + 0.256),
        (257, 2 * 0.01 + 0.257),
        (512, 2 * 0.01 + 0.512),
        (1000, 4 * 0.01 + 1.0),
    ],
)
def test_prefill_s_chunks_by_max_batched_tokens(prompt, expected):
    eng = EngineConstants(**engine_dict())  # max_batched_tokens 256
    assert eng.prefill_s(prompt) == approx(expected)


def test_prefill_s_with_default_budget_is_one_chunk_up_to_2048():
    eng = EngineConstants(**engine_dict(max_batched_tokens=2048))
    assert eng.prefill_s(2048) == approx(0.01 + 2.048)
    assert eng.prefill_s(2049) == approx(0.02 + 2.049)


@pytest.mark.parametrize("concurrency, expected", [(0, 0.011), (1, 0.011), (2, 0.012), (64, 0.074)])
def test_decode_token_s(concurrency, expected):
    assert EngineConstants(**engine_dict()).decode_token_s(concurrency) == approx(expected)


def test_step_s_is_linear():
    eng = EngineConstants(**engine_dict())
    assert eng.step_s(0, 0) == approx(0.01)
    assert eng.step_s(100, 3) == approx(0.01 + 0.1 + 0.003)


def test_cost_model_is_frozen():
    cm = make_cost_model()
    with pytest.raises(Exception):
        cm.name = "other"
    with pytest.raises(Exception):
        cm.engine.step_base_s = 0.5


def test_scaled_constants_scale_every_step_time_term_the_attention_included():
    c = EngineConstants(step_base_s=0.01, prefill_token_s=1e-4, decode_seq_s=1e-3, prefill_overhead_s=0.002,
                        prefill_attention_s=1e-8, kv_capacity_tokens=4096)
    big = c.scaled(3.0)
    for n in (16, 1000, 2048):
        assert big.prefill_s(n) == pytest.approx(3.0 * c.prefill_s(n))
        assert big.prefill_s(n, context_tokens=500) == pytest.approx(3.0 * c.prefill_s(n, context_tokens=500))
    assert big.decode_token_s(8) == pytest.approx(3.0 * c.decode_token_s(8))
    assert big.kv_capacity_tokens == c.kv_capacity_tokens and big.max_num_seqs == c.max_num_seqs
