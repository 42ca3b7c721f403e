"""The run config's rules on CPU: values that can never work are refused by field, with their range, on one line."""

from __future__ import annotations

import datetime

import pytest

from dflash.config import MAX_SEED, MAX_TOKENS, ConfigError, config_from_dict, load_config, parse_overrides


def refused(raw: dict | None = None, sets: tuple[str, ...] = ()) -> str:
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw or {}, parse_overrides(sets))
    line = e.value.one_line()
    assert line == str(e.value), "a config error is one line"
    return line


@pytest.mark.parametrize("field", ["train.weight_decay", "train.lr", "train.gamma", "train.grad_clip", "train.kl_weight",
                                   "train.warmup_ratio"])
@pytest.mark.parametrize("value", ["inf", "-inf", "nan"])
def test_floats_must_be_finite(field, value):
    assert f"{field}: Input should be a finite number" in refused(sets=(f"{field}={value}",))


@pytest.mark.parametrize("setting, says", [
    ("data.token_budget=100000000000000000000000", f"data.token_budget: Input should be less than or equal to {MAX_TOKENS}"),
    ("data.max_batch_size=100000000000000000000000", "data.max_batch_size: Input should be less than or equal to"),
    ("train.max_anchors=100000000000000000000000", "train.max_anchors: Input should be less than or equal to"),
    ("train.loss_chunk=100000000000000000000000", "train.loss_chunk: Input should be less than or equal to"),
    ("train.seed=-1", "train.seed: Input should be greater than or equal to 0"),
    (f"train.seed={MAX_SEED + 1}", f"train.seed: Input should be less than or equal to {MAX_SEED}"),
    ("train.weight_decay=2", "train.weight_decay: Input should be less than or equal to 1"),
    ("train.gamma=1e-300", "train.gamma: Input should be greater than or equal to 0.000001"),
    ("topology.timeout_s=100000000000000000000000", "topology.timeout_s: Input should be less than or equal to"),
    ("drafter.target_layer_ids=[3, -1]", "drafter.target_layer_ids.1: Input should be greater than or equal to 0"),
    ("drafter.mask_token_id=100000000000000000000000", "drafter.mask_token_id: Input should be less than or equal to"),
    ('output_dir=""', "output_dir: String should have at least 1 character"),
    ('target.path="a\\u0000b"', "target.path: contains a NUL character"),
])
def test_values_that_can_never_work_are_refused_with_their_range(setting, says):
    assert says in refused(sets=(setting,))


@pytest.mark.parametrize("drafter, says", [
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for num_layers = 5; give one per layer"),
    ({"layer_types": ["sliding_attention"] * 5}, "sliding_attention layers but sliding_window is not set"),
    ({"sliding_window": 64}, "sliding_window = 64 but no layer is sliding_attention"),
    ({"layer_types": ["sliding_attention"] * 5, "sliding_window": 16}, "sliding_window (16) must be >= block_size (32)"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "num_attention_heads (6) must be a multiple of num_key_value_heads (4)"),
    ({"layer_types": ["local_attention"] * 5}, "drafter.layer_types.0: Input should be 'full_attention' or 'sliding_attention'"),
    ({"head_dim": 3}, "drafter.head_dim: Input should be a multiple of 2"),
])
def test_drafter_shape_fields_are_checked_together(drafter, says):
    assert says in refused({"drafter": drafter})


def test_the_bounds_admit_every_committed_config():
    from pathlib import Path

    for path in sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.toml")):
        load_config(path)


def test_set_table_value_is_refused_not_a_silent_section_reset():
    line = refused({"train": {"epochs": 3}}, ("train={lr=1}",))
    assert "--set 'train={lr=1}': a table would replace all of train" in line and "--set train.lr=1" in line


def test_set_below_a_value_names_the_value():
    line = refused({"train": {"lr": 1e-3}}, ("train.lr.x=1",))
    assert "cannot set train.lr.x: train.lr is a value (0.001), not a section; set train.lr=VALUE" in line
    assert "train.lr: Input should be a valid number" in refused(sets=("train.lr.x=1",))
    assert "topology.target_gpus is a value ([])" in refused({"topology": {"target_gpus": []}}, ("topology.target_gpus.0=1",))
    assert "topology.target_gpus: Input should be a valid list" in refused(sets=("topology.target_gpus.0=1",))


@pytest.mark.parametrize("pair", ["train..lr=1", ".lr=1", "train.=1", "=1", "train.lr"])
def test_set_malformed_keys(pair):
    with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
        parse_overrides([pair])


def test_set_values_are_toml_dates_and_bad_toml_are_strings():
    assert parse_overrides(["output_dir=1979-05-27", "target.path=/models/q", " train.lr = 1e-4"]) == {
        "output_dir": "1979-05-27", "target.path": "/models/q", "train.lr": 1e-4}
    assert config_from_dict({}, parse_overrides(["output_dir=1979-05-27T07:32:00Z"])).output_dir == "1979-05-27T07:32:00Z"
    assert parse_overrides(["target.path=" + "[" * 2000]) == {"target.path": "[" * 2000}  # too deep for TOML: a string


def test_toml_datetime_in_a_file_names_its_field(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("output_dir = 1979-05-27T07:32:00Z\n[train]\nlr = 1979-05-27\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert "output_dir: Input should be a valid string" in str(e.value) and "train.lr: Input should be a valid number" in str(e.value)
    assert "output_dir: Input should be a valid string" in refused({"output_dir": datetime.time(7, 32)})


@pytest.mark.parametrize("content, says", [
    (b"output_dir = \"r\xff\xfe\"\n", "not UTF-8 text (byte ff at offset 15); save the config as UTF-8 TOML"),
    (b"a = " + b"[" * 3000 + b"]" * 3000, "nested too deeply"),
    (b"[train\n", "not valid TOML"),
    (b"train = 5\n", "train: Input should be a valid dictionary"),
])
def test_unreadable_config_files_are_one_line(tmp_path, content, says):
    path = tmp_path / "run.toml"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert says in e.value.one_line()
    with pytest.raises(ConfigError, match="is a directory|cannot read"):
        load_config(tmp_path)


@pytest.mark.parametrize("topology, says", [
    ({"colocated_gpus": ["0", "1"], "target_gpus": ["2"], "drafter_gpus": ["3"]},
     "topology.colocated_gpus excludes target_gpus and drafter_gpus"),
    ({"colocated_gpus": ["0"]}, "topology.colocated_gpus lists 1 GPU; co-located data parallel needs at least 2"),
    ({"colocated_gpus": ["0", "1", "0"]}, "topology.colocated_gpus lists GPUs ['0'] more than once"),
])
def test_colocated_gpus_are_their_own_layout(topology, says):
    assert says in refused({"topology": topology})


def test_topology_names_its_layout_and_the_gpus_that_train():
    layouts = {name: config_from_dict({"topology": t}).topology for name, t in {
        "colocated": {}, "colocated-dp": {"colocated_gpus": ["0", "1", "2"]},
        "split": {"target_gpus": ["0"], "drafter_gpus": ["1", "2"]}}.items()}
    assert {name: (t.layout, t.trainer_gpus) for name, t in layouts.items()} == {
        "colocated": ("colocated", []), "colocated-dp": ("colocated-dp", ["0", "1", "2"]),
        "split": ("split", ["1", "2"])}


def test_every_gpu_has_one_role_in_rank_order_whatever_the_layout():
    """TopologyConfig.gpu_roles is the one rule for roles: the drafter's GPUs first (rank order), one vocabulary."""
    topo = lambda t: config_from_dict({"topology": t}).topology  # noqa: E731
    one, dp = topo({}), topo({"colocated_gpus": ["2", "0"]})
    split = topo({"target_gpus": ["0", "1", "2", "3", "4"], "drafter_gpus": ["5", "6", "7"]})
    assert one.gpu_roles == {"0": "colocated"} and dp.gpu_roles == {"2": "colocated", "0": "colocated"}
    assert list(split.gpu_roles.items()) == [("5", "drafter"), ("6", "drafter"), ("7", "drafter"), ("0", "target"),
                                             ("1", "target"), ("2", "target"), ("3", "target"), ("4", "target")]
    assert [(t.roles, t.trainer_role) for t in (one, dp, split)] == [
        (["colocated"], "colocated"), (["colocated"], "colocated"), (["target", "drafter"], "drafter")]


@pytest.mark.parametrize("raw, says", [
    ({"train": {"cache_features": True}}, "train.cache_features works on one device only"),
    ({"eval": {"holdout": 4}}, "[eval] works in one-device co-located runs only for now"),
])
def test_colocated_data_parallel_refuses_what_one_process_only_does(raw, says):
    assert says in refused({**raw, "topology": {"colocated_gpus": ["0", "1"]}})


def test_ddtree_budget_needs_real_prompts_and_slot_weights_name_their_values():
    with pytest.raises(ConfigError, match="eval.ddtree_budget decodes the eval.real_prompts: set real_prompts >= 1"):
        config_from_dict({"eval": {"holdout": 4, "ddtree_budget": 16}})
    assert config_from_dict({"eval": {"holdout": 4, "real_prompts": 2, "ddtree_budget": 16}}).eval.ddtree_budget == 16
    with pytest.raises(ConfigError, match="train.slot_weights: Input should be 'gamma', 'cap', 'dpace' or 'auf'"):
        config_from_dict({"train": {"slot_weights": "CAP"}})
    with pytest.raises(ConfigError, match="train.cap_alpha: Input should be less than or equal to 1"):
        config_from_dict({"train": {"cap_alpha": 1.5}})


def test_packing_refuses_pack_remainders_and_moves_the_target_hash():
    """data.packing leaves no buckets, so pack_remainders (the buckets' remainders packed) has no meaning beside it:
    one line naming both keys. The packs are other shapes than the buckets: another compile-cache target hash."""
    line = refused({"data": {"packing": True, "pack_remainders": True}})
    assert "data.pack_remainders" in line and "data.packing = true" in line
    assert line.endswith("set data.pack_remainders = false")
    plain, packed = config_from_dict({}), config_from_dict({"data": {"packing": True}})
    assert packed.data.packing and not plain.data.packing
    assert packed.target_hash() != plain.target_hash()
    assert config_from_dict({"data": {"pack_remainders": True}}).target_hash() not in (plain.target_hash(),
                                                                                        packed.target_hash())


def test_errors_blame_where_the_value_came_from(tmp_path):
    """A value from --set is blamed on that --set; a section's rule broken by a flag names the file and the flag; a
    value of the file alone names the file."""
    from dflash.config import Overrides

    path = tmp_path / "run.toml"
    path.write_text('[train]\ndata_parallel = "fsdp2"\n[topology]\ncolocated_gpus = ["0", "1"]\n')
    with pytest.raises(ConfigError) as e:
        load_config(path, parse_overrides(["train.lr=2"]))
    assert str(e.value) == "--set train.lr=2: train.lr: Input should be less than or equal to 1"
    flags = Overrides()
    for key, value in (("topology.colocated_gpus", []), ("topology.target_gpus", ["0"]), ("topology.drafter_gpus", ["1"])):
        flags.put(key, value, "--target-gpus 0, --drafter-gpus 1")
    with pytest.raises(ConfigError) as e:
        load_config(path, flags)
    assert str(e.value).startswith(f"{path} with --target-gpus 0, --drafter-gpus 1: (top level): train.data_parallel "
                                   '= "fsdp2" shards the drafter over co-located data-parallel ranks')
    path.write_text("[topology]\ncolocated_gpus = [0, 1, 2]\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value) == (f'{path}: topology.colocated_gpus: GPU names are strings, got 0; quote each GPU name: '
                            'colocated_gpus = ["0", "1", "2"]')
    with pytest.raises(ConfigError) as e:
        load_config(path, parse_overrides(["topology.colocated_gpus=4,5"]))
    assert str(e.value) == ("--set topology.colocated_gpus=4,5: topology.colocated_gpus: give a list of GPU names, got "
                            """'4,5'; quote each GPU name: --set 'topology.colocated_gpus=["4","5"]'""")


@pytest.mark.parametrize("raw, says", [
    ({"data": {"token_budjet": 1}}, "data.token_budjet: unknown key; did you mean data.token_budget? (check spelling"),
    ({"train": {"token_budget": 1}}, "train.token_budget: unknown key; did you mean data.token_budget?"),
    ({"trian": {}}, "trian: unknown key; did you mean train?"),
    ({"train": {"zzz": 1}}, "train.zzz: unknown key (check spelling; see configs/ for the allowed keys)"),
])
def test_unknown_keys_name_the_closest_known_one(raw, says):
    with pytest.raises(ConfigError) as e:
        config_from_dict(raw)
    assert str(e.value).startswith(f"config: {says}"), str(e.value)


def test_target_precision_is_bf16_or_fp8_and_fp8_compiles_on_cuda():
    """target.precision: bf16 by default; fp8 on CPU (emulated) and on CUDA with target.compile; anything else, or
    fp8 uncompiled on CUDA, is one line naming the field and the fix. fp8 graphs get their own compile-cache hash,
    bf16 keeps the hash configs had before the field."""
    plain = config_from_dict({})
    assert plain.target.precision == "bf16"
    assert config_from_dict({"device": "cpu", "target": {"precision": "fp8", "compile": False}}).target.precision == "fp8"
    line = refused({"target": {"precision": "fp8e4"}})
    assert line == "config: target.precision: Input should be 'bf16' or 'fp8'", line
    line = refused({"target": {"precision": "fp8", "compile": False}})
    assert "\n" not in line and 'target.precision = "fp8" needs target.compile = true on CUDA' in line, line
    assert line.endswith('set target.compile = true or target.precision = "bf16"')
    fp8 = config_from_dict({"target": {"precision": "fp8"}})
    assert fp8.target_hash() != plain.target_hash()
    assert plain.target_hash() == config_from_dict({"target": {"precision": "bf16"}}).target_hash()
    assert fp8.drafter_hash() == plain.drafter_hash()  # the drafter's graphs do not change
