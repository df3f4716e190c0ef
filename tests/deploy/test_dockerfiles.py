"""The images (deploy/docker/*.Dockerfile) cannot be built here (no Docker engine), so their invariants are read
from the files: pinned base images, a non-root numeric USER that matches the chart, a HEALTHCHECK on the route the
chart probes, the repository's torch pin, and COPY sources that exist and are not excluded by .dockerignore."""
from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy.conftest import CHART, REPO

DOCKER = REPO / "deploy" / "docker"
IMAGES = {"platform": ("platform.Dockerfile", "/healthz"), "engine": ("engine.Dockerfile", "/health")}


def instructions(path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        if line.lstrip().startswith("#") and not pending:
            continue
        pending += line.rstrip("\\").strip() + " " if line.endswith("\\") else line.strip()
        if line.endswith("\\"):
            continue
        if pending:
            op, _, args = pending.partition(" ")
            out.append((op.upper(), args.strip()))
        pending = ""
    return out


def dockerignore() -> set[str]:
    return {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
            if line.strip() and not line.startswith("#")}


def chart_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text())


@pytest.mark.parametrize("image", list(IMAGES))
def test_base_image_is_pinned(image):
    froms = [args for op, args in instructions(DOCKER / IMAGES[image][0]) if op == "FROM"]
    assert len(froms) == 1, froms
    ref = froms[0].split()[0]
    assert "$" not in ref, f"{image}: the base image must be written out, not taken from an ARG"
    name, _, tag = ref.rpartition(":")
    assert name and tag != "latest" and re.search(r"\d+\.\d+", tag), f"{image}: unpinned base image {ref!r}"


@pytest.mark.parametrize("image", list(IMAGES))
def test_runs_as_the_charts_non_root_user(image):
    ins = instructions(DOCKER / IMAGES[image][0])
    users = [i for i, (op, _) in enumerate(ins) if op == "USER"]
    assert users, f"{image}: no USER instruction (the image would run as root)"
    last_run = max(i for i, (op, _) in enumerate(ins) if op == "RUN")
    assert users[-1] > last_run, f"{image}: a RUN follows the last USER"
    uid, _, gid = ins[users[-1]][1].partition(":")
    assert uid.isdigit() and int(uid) > 0, f"{image}: USER must be a numeric non-root uid (runAsNonRoot checks it)"
    ctx = chart_values()["podSecurityContext"]
    assert (int(uid), int(gid)) == (ctx["runAsUser"], ctx["runAsGroup"])


@pytest.mark.parametrize("image", list(IMAGES))
def test_healthcheck_entrypoint_and_port_match_the_chart(image):
    file, route = IMAGES[image]
    ins = dict((op, args) for op, args in instructions(DOCKER / file))
    port = chart_values()[image]["port"]
    assert ins["EXPOSE"] == str(port)
    assert "CMD" in ins["HEALTHCHECK"] and f"127.0.0.1:{port}{route}'" in ins["HEALTHCHECK"]
    assert ins["ENTRYPOINT"] == '["loraplex"]'


@pytest.mark.parametrize("image", list(IMAGES))
def test_torch_is_pinned_as_bootstrap_pins_it(image):
    pin = re.search(r'"torch==([^"]+)"', (REPO / "scripts" / "bootstrap.sh").read_text()).group(1)
    text = (DOCKER / IMAGES[image][0]).read_text()
    assert f"ARG TORCH_VERSION={pin}\n" in text and '"torch==${TORCH_VERSION}"' in text
    if image == "platform":
        assert "--index-url https://download.pytorch.org/whl/cpu" in text  # not the multi-GB CUDA build


@pytest.mark.parametrize("image", list(IMAGES))
def test_copy_sources_exist_and_are_in_the_build_context(image):
    ignored = dockerignore()
    assert {".git", ".venv"} <= ignored
    copies = [args for op, args in instructions(DOCKER / IMAGES[image][0]) if op == "COPY"]
    assert copies
    for args in copies:
        for src in args.split()[:-1]:
            top = src.rstrip("/").split("/")[0]
            assert (REPO / src).exists(), f"{image}: COPY {src} does not exist"
            assert top not in ignored, f"{image}: COPY {src} is excluded by .dockerignore"
