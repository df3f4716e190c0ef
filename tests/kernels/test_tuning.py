import json
import logging

import pytest

from loraplex.kernels import tuning

DEFAULT = {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 4}


@pytest.fixture
def tdir(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tmp_path))
    tuning.clear_cache()
    yield tmp_path
    tuning.clear_cache()


def test_device_folder_name_replaces_spaces():
    assert tuning.device_folder_name("NVIDIA H200") == "NVIDIA_H200"
    with pytest.raises(ValueError, match="device name is empty"):
        tuning.device_folder_name("  ")


def test_config_path_is_shared_by_writer_and_reader(tdir):
    path = tuning.write_configs("fused_moe", {"E=4,N=8": {16: {"BLOCK_M": 32}}}, device_name="NVIDIA H200")
    assert path == tdir / "NVIDIA_H200" / "fused_moe.json" == tuning.config_path("fused_moe", "NVIDIA H200")
    assert json.loads(path.read_text()) == {"E=4,N=8": {"16": {"BLOCK_M": 32}}}


def test_nearest_m_wins_and_ties_go_low(tdir):
    tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 1}, 16: {"BLOCK_M": 16}, 64: {"BLOCK_M": 64}}},
                         device_name="gpu")
    pick = lambda m: tuning.get_config("op", {"K": 8}, m, DEFAULT, device_name="gpu")["BLOCK_M"]  # noqa: E731
    assert [pick(m) for m in (1, 7, 9, 33, 40, 41, 1000)] == [1, 1, 16, 16, 16, 64, 64]
    assert pick(8) == 1  # 7 from 1, 8 from 16
    # missing keys are filled from the default
    assert tuning.get_config("op", {"K": 8}, 16, DEFAULT, device_name="gpu")["num_warps"] == 4


def test_missing_file_warns_once_and_uses_default(tdir, caplog):
    with caplog.at_level(logging.WARNING, logger="loraplex.kernels.tuning"):
        for m in (1, 2, 3):
            assert tuning.get_config("nope", {"K": 1}, m, DEFAULT, device_name="gpu") == DEFAULT
    warnings = [r for r in caplog.records if "no tuning file" in r.getMessage()]
    assert len(warnings) == 1 and "nope.json" in warnings[0].getMessage()


def test_unknown_shape_falls_back(tdir, caplog):
    tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 1}}}, device_name="gpu")
    with caplog.at_level(logging.WARNING, logger="loraplex.kernels.tuning"):
        assert tuning.get_config("op", {"K": 9}, 1, DEFAULT, device_name="gpu") == DEFAULT
    assert "no entry for shape K=9" in caplog.text


def test_untuned_lists_the_lookups_that_fell_back_once_each_in_order(tdir):
    tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 1}}}, device_name="gpu")
    assert tuning.untuned() == []
    for m in (1, 16, 1000):
        tuning.get_config("op", {"K": 8}, m, DEFAULT, device_name="gpu")  # tuned: not listed
        tuning.get_config("op", {"K": 9}, m, DEFAULT, device_name="gpu")  # a shape the file lacks
        tuning.get_config("other", {"K": 8}, m, DEFAULT, device_name="gpu")  # no file at all
    assert tuning.untuned() == ["op K=9", "other (no tuning file for gpu)"]
    tuning.write_configs("op", {"K=9": {1: {"BLOCK_M": 2}}}, device_name="gpu")  # a tune fills the gap
    tuning.get_config("op", {"K": 9}, 1, DEFAULT, device_name="gpu")
    tuning.get_config("other", {"K": 8}, 1, DEFAULT, device_name="gpu")
    assert tuning.untuned() == ["other (no tuning file for gpu)"]
    tuning.clear_cache()
    assert tuning.untuned() == []


def test_files_are_cached(tdir):
    path = tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 1}}}, device_name="gpu")
    assert tuning.get_config("op", {"K": 8}, 1, DEFAULT, device_name="gpu")["BLOCK_M"] == 1
    path.write_text(json.dumps({"K=8": {"1": {"BLOCK_M": 128}}}))
    assert tuning.get_config("op", {"K": 8}, 1, DEFAULT, device_name="gpu")["BLOCK_M"] == 1  # cached
    tuning.clear_cache()
    assert tuning.get_config("op", {"K": 8}, 1, DEFAULT, device_name="gpu")["BLOCK_M"] == 128


def test_lookups_are_memoised_but_follow_new_files_and_folders(tdir, tmp_path_factory, monkeypatch):
    """get_config memoises per (op, shape, M, device, folder): a caller mutating its copy changes nothing, a
    write_configs is seen at once, and pointing LORAPLEX_TUNING_DIR elsewhere reads that folder."""
    tuning.write_configs("op", {"K=8": {16: {"BLOCK_M": 16}}}, device_name="gpu")
    first = tuning.get_config("op", {"K": 8}, 16, DEFAULT, device_name="gpu")
    first["BLOCK_M"] = 999
    assert tuning.get_config("op", {"K": 8}, 16, DEFAULT, device_name="gpu")["BLOCK_M"] == 16
    tuning.write_configs("op", {"K=8": {16: {"BLOCK_M": 32}}}, device_name="gpu")
    assert tuning.get_config("op", {"K": 8}, 16, DEFAULT, device_name="gpu")["BLOCK_M"] == 32
    other = tmp_path_factory.mktemp("other-tuning")
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(other))
    assert tuning.get_config("op", {"K": 8}, 16, DEFAULT, device_name="gpu") == DEFAULT  # no file there
    monkeypatch.setenv(tuning.TUNING_DIR_ENV, str(tdir))
    assert tuning.get_config("op", {"K": 8}, 16, DEFAULT, device_name="gpu")["BLOCK_M"] == 32


def test_bad_json_names_the_file(tdir):
    path = tuning.config_path("op", "gpu")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(tuning.TuningConfigError, match="op.json is not valid JSON"):
        tuning.get_config("op", {"K": 8}, 1, DEFAULT, device_name="gpu")


def test_write_merges_other_shapes(tdir):
    tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 1}}}, device_name="gpu")
    path = tuning.write_configs("op", {"K=9": {4: {"BLOCK_M": 4}}, "K=8": {2: {"BLOCK_M": 2}}}, device_name="gpu")
    assert json.loads(path.read_text()) == {"K=8": {"1": {"BLOCK_M": 1}, "2": {"BLOCK_M": 2}},
                                            "K=9": {"4": {"BLOCK_M": 4}}}


def test_repo_tuning_files_parse():
    """Committed files load and every entry is keyed by integer M."""
    tuning.clear_cache()
    for path in tuning._REPO_TUNING_DIR.glob("*/*.json"):
        if path.name == tuning.ALIAS_FILE:
            continue  # an alias, not an op file: test_committed_device_folders_hold_op_files_or_a_valid_alias
        table = tuning._load(str(path))
        assert table, f"{path} is empty"
        for by_m in table.values():
            assert all(isinstance(m, int) for m in by_m)


def test_committed_configs_lists_each_config_of_a_file_once():
    """The helper behind the committed-config kernel tests: every config of the op's files, none twice (several M
    of one shape often share a config)."""
    import json

    from tests.utils.tuning_files import committed_configs

    for path in tuning._REPO_TUNING_DIR.glob("*/*.json"):
        if path.name == tuning.ALIAS_FILE:
            continue
        listed = committed_configs(path.stem)
        assert all(cfg not in listed[:i] for i, cfg in enumerate(listed)), path.stem
        for by_m in json.loads(path.read_text(encoding="utf-8")).values():
            assert all(cfg in listed for cfg in by_m.values()), path.stem


def test_plan_cache_remembers_per_config_and_shape():
    """A launcher's plan is worked out once per (config items, shape items): the same object for an equal config
    (a fresh dict each call, as get_config returns), a new one when a value or a dim changes, and a config holding
    an unhashable value is worked out afresh each time."""
    calls = []

    @tuning.plan_cache
    def plan(cfg, *, m):
        calls.append((dict(cfg), m))
        return {"grid": cfg["BLOCK"] * m}

    first = plan({"BLOCK": 16}, m=4)
    assert plan({"BLOCK": 16}, m=4) is first and len(calls) == 1
    assert plan({"BLOCK": 32}, m=4) == {"grid": 128} and plan({"BLOCK": 16}, m=8) == {"grid": 128}
    assert len(calls) == 3
    odd = {"BLOCK": 16, "TILES": [1, 2]}
    assert plan(odd, m=4) == first and plan(odd, m=4) is not plan(odd, m=4)
    plan.cache_clear()
    assert plan({"BLOCK": 16}, m=4) is not first


# same_as.json: a device folder reading another device's configs


def _alias(root, device, target, **extra):
    folder = root / device
    folder.mkdir(parents=True, exist_ok=True)
    (folder / tuning.ALIAS_FILE).write_text(json.dumps({"device": target, "reason": "test", **extra}))
    tuning.clear_cache()


def _block_m(op, device, m=1):
    return tuning.get_config(op, {"K": 8}, m, DEFAULT, device_name=device)["BLOCK_M"]


def test_alias_is_read_when_the_own_file_is_missing_and_the_own_file_wins(tdir):
    h200 = tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 200}}}, device_name="NVIDIA H200")
    tuning.write_configs("other", {"K=8": {1: {"BLOCK_M": 201}}}, device_name="NVIDIA H200")
    _alias(tdir, "H100", "NVIDIA_H200")
    assert _block_m("op", "H100") == 200 and _block_m("other", "H100") == 201
    assert tuning.read_path("op", "H100") == h200
    own = tdir / "H100" / "op.json"
    own.write_text(json.dumps({"K=8": {"1": {"BLOCK_M": 100}}}))
    tuning.clear_cache()
    assert _block_m("op", "H100") == 100 and _block_m("other", "H100") == 201  # own file wins for its op only
    assert tuning.read_path("op", "H100") == own
    assert tuning.device_files("H100") == {"op": own, "other": tdir / "NVIDIA_H200" / "other.json"}
    assert tuning.read_path("missing", "H100") is None
    assert tuning.device_files("NVIDIA H200") == {"op": h200, "other": tdir / "NVIDIA_H200" / "other.json"}


def test_tuned_ms_follows_the_same_rule(tdir):
    tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 1}, 64: {"BLOCK_M": 64}}}, device_name="base")
    tuning.write_configs("other", {"K=8": {512: {"BLOCK_M": 16}}}, device_name="base")
    _alias(tdir, "gpu", "base")
    assert tuning.tuned_ms("gpu", tdir) == {1, 64, 512}
    tuning.write_configs("op", {"K=8": {16: {"BLOCK_M": 16}}}, device_name="gpu")  # own op.json, from base's
    assert tuning.tuned_ms("gpu", tdir) == {1, 16, 64, 512}
    (tdir / "gpu" / "op.json").write_text(json.dumps({"K=8": {"32": {"BLOCK_M": 32}}}))  # own file hides base's
    tuning.clear_cache()
    assert tuning.tuned_ms("gpu", tdir) == {32, 512}
    assert tuning.tuned_ms("base", tdir) == {1, 64, 512}


def test_alias_chain_is_followed(tdir):
    tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 3}}}, device_name="C")
    tuning.write_configs("mid", {"K=8": {1: {"BLOCK_M": 2}}}, device_name="B")
    _alias(tdir, "B", "C")
    _alias(tdir, "A", "B")
    assert _block_m("op", "A") == 3 and _block_m("mid", "A") == 2
    assert tuning.device_files("A") == {"mid": tdir / "B" / "mid.json", "op": tdir / "C" / "op.json"}


def test_alias_cycle_raises_naming_the_files(tdir):
    tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 3}}}, device_name="B")
    _alias(tdir, "A", "B")
    _alias(tdir, "B", "A")
    with pytest.raises(tuning.TuningConfigError, match="cycle") as err:
        tuning.get_config("op", {"K": 8}, 1, DEFAULT, device_name="A")
    assert str(tdir / "A" / "same_as.json") in str(err.value) and str(tdir / "B" / "same_as.json") in str(err.value)
    _alias(tdir, "self", "self")
    with pytest.raises(tuning.TuningConfigError, match="cycle"):
        tuning.tuned_ms("self", tdir)


@pytest.mark.parametrize("text,match", [
    ("{not json", "not valid JSON"),
    ('["NVIDIA_H200"]', "expected an object"),
    ('{"reason": "no device"}', "must name a device folder"),
    ('{"device": ""}', "must name a device folder"),
    ('{"device": 7}', "must name a device folder"),
    ('{"device": "../NVIDIA_H200"}', "folder name under the same root"),
    ('{"device": "x\\\\y"}', "folder name under the same root"),
    ('{"device": ".."}', "folder name under the same root"),
])
def test_bad_alias_file_raises_naming_it(tdir, text, match):
    tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 3}}}, device_name="NVIDIA_H200")
    (tdir / "gpu").mkdir()
    (tdir / "gpu" / tuning.ALIAS_FILE).write_text(text)
    tuning.clear_cache()
    with pytest.raises(tuning.TuningConfigError, match=match) as err:
        tuning.get_config("op", {"K": 8}, 1, DEFAULT, device_name="gpu")
    assert str(tdir / "gpu" / "same_as.json") in str(err.value)


def test_alias_to_a_missing_folder_raises(tdir):
    _alias(tdir, "gpu", "NVIDIA_H999")
    with pytest.raises(tuning.TuningConfigError, match="NVIDIA_H999 does not exist"):
        tuning.read_path("op", "gpu")


def test_missing_file_warning_names_the_own_and_the_aliased_path(tdir, caplog):
    (tdir / "base").mkdir()
    _alias(tdir, "gpu", "base")
    with caplog.at_level(logging.WARNING, logger="loraplex.kernels.tuning"):
        for m in (1, 2):
            assert tuning.get_config("nope", {"K": 1}, m, DEFAULT, device_name="gpu") == DEFAULT
    (warning,) = [r.getMessage() for r in caplog.records if "no tuning file" in r.getMessage()]
    assert str(tdir / "gpu" / "nope.json") in warning and str(tdir / "base" / "nope.json") in warning


def test_write_configs_writes_the_own_folder_even_with_an_alias(tdir):
    base = tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 200}}, "K=9": {1: {"BLOCK_M": 9}}}, device_name="base")
    _alias(tdir, "gpu", "base")
    assert _block_m("op", "gpu") == 200
    path = tuning.write_configs("op", {"K=8": {1: {"BLOCK_M": 100}}}, device_name="gpu")
    assert path == tdir / "gpu" / "op.json" == tuning.config_path("op", "gpu")
    # the first own file starts from the aliased file's entries: K=9 (not tuned here) is kept
    assert json.loads(path.read_text()) == {"K=8": {"1": {"BLOCK_M": 100}}, "K=9": {"1": {"BLOCK_M": 9}}}
    assert json.loads(base.read_text())["K=8"] == {"1": {"BLOCK_M": 200}}  # the aliased file is untouched
    assert _block_m("op", "gpu") == 100  # seen at once: write_configs forgets the cached lookups
    # later writes merge into the own file, not the alias's
    tuning.write_configs("op", {"K=8": {16: {"BLOCK_M": 116}}}, device_name="gpu")
    assert json.loads(path.read_text())["K=8"] == {"1": {"BLOCK_M": 100}, "16": {"BLOCK_M": 116}}
    assert json.loads(base.read_text())["K=8"] == {"1": {"BLOCK_M": 200}}
    assert (tdir / "gpu" / tuning.ALIAS_FILE).is_file()
    with pytest.raises(ValueError, match="bad op name"):
        tuning.write_configs("same_as", {"K=8": {1: {"BLOCK_M": 1}}}, device_name="gpu")


def test_committed_h100_folder_reads_every_op_of_the_h200():
    tuning.clear_cache()
    root = tuning._REPO_TUNING_DIR
    h200 = tuning.device_files("NVIDIA H200", root)
    assert h200 and all(p.parent == root / "NVIDIA_H200" for p in h200.values())
    h100 = tuning.device_files("NVIDIA H100 80GB HBM3", root)
    own = {p.stem for p in (root / "NVIDIA_H100_80GB_HBM3").glob("*.json")} - {"same_as"}
    assert h100 == {op: (root / "NVIDIA_H100_80GB_HBM3" / f"{op}.json" if op in own else path)
                    for op, path in h200.items()}
    for op in h200:
        assert tuning.read_path(op, "NVIDIA H100 80GB HBM3", root) == h100[op]
    assert tuning.tuned_ms("NVIDIA H100 80GB HBM3", root) == tuning.tuned_ms("NVIDIA H200", root)


def test_committed_device_folders_hold_op_files_or_a_valid_alias():
    tuning.clear_cache()
    root = tuning._REPO_TUNING_DIR
    folders = [f for f in root.iterdir() if f.is_dir() and f.name != "__pycache__"]
    assert folders
    for folder in folders:
        alias = folder / tuning.ALIAS_FILE
        ops = [p for p in folder.glob("*.json") if p.name != tuning.ALIAS_FILE]
        assert ops or alias.is_file(), f"{folder} holds neither op files nor {tuning.ALIAS_FILE}"
        if alias.is_file():
            raw = json.loads(alias.read_text(encoding="utf-8"))
            assert set(raw) == {"device", "reason"} and raw["reason"].strip(), alias
            assert tuning.device_files(folder.name, root), f"{alias} resolves to no op files"


H100_OWN_MS = {"1024"}  # the entries where the H100's own MXFP4 file keeps a tile of its own
H100_ONE_LAUNCH_MS = {"2", "4"}  # the entries where the H100 takes the one launch
H200_ONE_LAUNCH_MS = {"2"}  # the entries where the H200 takes it


def _two_launch(by_m: dict) -> dict:
    return {m: {k: v for k, v in cfg.items() if not k.startswith("ONE_")} for m, cfg in by_m.items()}


def test_the_h100s_own_mxfp4_file_differs_from_the_h200s_only_where_the_h100_keeps_its_own_tile():
    """The H100's fused_moe_mxfp4.json has the H200's two-launch tiles but at M = 1024, where the H200's 8-warp
    prefill tile timed 3% slower on the H100 than the 4-warp one it keeps; each card adds the one-launch keys
    (``fused_moe_mxfp4_one_launch``) where they timed faster on it: the H100 at M = 2 and 4 (5-6%), the H200 at
    M = 2 (3%). The two-launch keys stay, as the expert LoRA path runs them. Every other two-launch entry must stay
    the H200's (a retune on the H200 is to be copied into it, and this test fails until it is)."""
    root = tuning._REPO_TUNING_DIR
    h100 = json.loads((root / "NVIDIA_H100_80GB_HBM3" / "fused_moe_mxfp4.json").read_text(encoding="utf-8"))
    h200 = json.loads((root / "NVIDIA_H200" / "fused_moe_mxfp4.json").read_text(encoding="utf-8"))
    assert h100.keys() == h200.keys()
    for shape, by_m in h200.items():
        assert h100[shape].keys() == by_m.keys()
        mine, theirs = _two_launch(h100[shape]), _two_launch(by_m)
        assert {m for m in by_m if mine[m] != theirs[m]} <= H100_OWN_MS, shape
        assert {m for m, cfg in h100[shape].items() if cfg.get("ONE_LAUNCH")} == H100_ONE_LAUNCH_MS, shape
        assert {m for m, cfg in by_m.items() if cfg.get("ONE_LAUNCH")} == H200_ONE_LAUNCH_MS, shape


# (shape, M) entries each card tuned on its own: the o projection's LoRA (one slice) at every M, and the qkv
# shrink at prefill sizes
CARD_OWN_DENSE_LORA_MS = {"S=3,R=32,K=2880": {"1024", "2048"}}


@pytest.mark.parametrize("op", ["lora_shrink", "lora_expand"])
def test_the_h100s_dense_lora_files_match_the_h200s_except_the_entries_each_card_tuned_itself(op):
    """Both cards' dense LoRA files hold the same shapes and M entries. The o projection (one slice) and the
    qkv shrink at M = 1024 and 2048 were tuned on each card; every other entry must stay the H200's in the H100's
    file (a retune on the H200 is to be copied into it, and this test fails until it is)."""
    root = tuning._REPO_TUNING_DIR
    h100 = json.loads((root / "NVIDIA_H100_80GB_HBM3" / f"{op}.json").read_text(encoding="utf-8"))
    h200 = json.loads((root / "NVIDIA_H200" / f"{op}.json").read_text(encoding="utf-8"))
    assert h100.keys() == h200.keys()
    assert any(shape.startswith("S=1,") for shape in h200), sorted(h200)  # the o projection
    for shape, by_m in h200.items():
        assert h100[shape].keys() == by_m.keys(), shape
        if shape.startswith("S=1,"):
            continue
        differ = {m for m in by_m if h100[shape][m] != by_m[m]}
        assert differ <= CARD_OWN_DENSE_LORA_MS.get(shape, set()), (shape, differ)
