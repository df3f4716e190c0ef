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
