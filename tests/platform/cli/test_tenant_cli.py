"""``loraplex adapters`` and ``loraplex keys`` as subprocesses against the live app (PostgreSQL, Redis, moto's S3):
upload of a folder and of an archive (Idempotency-Key, dedupe), list, versions, alias, rollback, delete, import from
S3, keys; configuration from the environment and from a config-file profile; errors as one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import uuid

from tests.security.live_stack import lora_files

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def cli(env: dict, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "loraplex.cli", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)
    if ok:
        assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def folder(tmp_path, name: str, files: dict[str, bytes]) -> str:
    path = tmp_path / name
    path.mkdir()
    for n, b in files.items():
        (path / n).write_bytes(b)
    return str(path)


def test_adapter_lifecycle_from_the_command_line(stack, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(LORAPLEX_URL=stack.server.url, LORAPLEX_API_KEY=stack.owner_key, LORAPLEX_PROGRESS="0",
               LORAPLEX_CONFIG=str(tmp_path / "none.toml"), PYTHONPATH=ROOT)
    name = f"cli-{uuid.uuid4().hex[:6]}"
    v1 = folder(tmp_path, "v1", lora_files(stack.base, value=0.01))
    out = json.loads(cli(env, "adapters", "upload", v1, "--name", name, "--json").stdout)
    assert out["number"] == 1 and out["status"] == "ready" and out["deduplicated"] is False
    again = cli(env, "adapters", "upload", v1, "--name", name).stdout
    assert "v1 ready" in again and "identical to an existing version" in again
    archive = tmp_path / "v2.tar.gz"
    v2 = folder(tmp_path, "v2", lora_files(stack.base, value=0.02))
    with tarfile.open(archive, "w:gz") as tf:
        for n in os.listdir(v2):
            tf.add(os.path.join(v2, n), arcname=n)
    assert f"{name} v2 ready" in cli(env, "adapters", "upload", str(archive), "--name", name).stdout
    listed = cli(env, "adapters", "list").stdout.splitlines()
    assert listed[0].split() == ["NAME", "LATEST", "ALIASES", "CREATED"]
    assert any(line.split()[:2] == [name, "2"] for line in listed[1:]), listed
    assert f"{name}:prod -> version 1" in cli(env, "adapters", "alias", name, "prod", "1").stdout
    assert f"{name}:latest -> version 1 (was 2)" in cli(env, "adapters", "rollback", name, "1").stdout
    history = json.loads(cli(env, "adapters", "versions", name, "--json").stdout)
    assert [(v["number"], sorted(v["aliases"])) for v in history["data"]] == [(2, []), (1, ["latest", "prod"])]
    table = cli(env, "adapters", "versions", name).stdout.splitlines()
    assert table[0].split()[:3] == ["VERSION", "STATUS", "ALIASES"] and table[2].split()[:3] == ["1", "ready",
                                                                                               "latest,prod"]
    assert "removed" in cli(env, "adapters", "alias", name, "prod", "--delete").stdout
    assert f"deleted {name}:2" in cli(env, "adapters", "delete", f"{name}:2").stdout
    # import from S3 (the stack's moto; the platform's own bucket is refused, so a bucket of the tenant's)
    import boto3

    endpoint = stack.server.app.state.settings.s3_endpoint_url
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="testing",
                      aws_secret_access_key="testing")
    bucket = f"tenant-{uuid.uuid4().hex[:8]}"
    s3.create_bucket(Bucket=bucket)
    for n, b in lora_files(stack.base, value=0.03).items():
        s3.put_object(Bucket=bucket, Key=f"run/{n}", Body=b)
    settings = stack.server.app.state.settings
    settings.import_s3_endpoints = [endpoint]        # the operator allows this endpoint (the live app's settings)
    settings.import_s3_buckets = [bucket]            # and this bucket (the stack allows none by default)
    out = cli(env, "adapters", "import", name, f"s3://{bucket}/run/", "--endpoint-url", endpoint, "--region",
              "us-east-1", "--aws-access-key-id", "testing", "--aws-secret-access-key", "testing").stdout
    assert "succeeded" in out and f"{name} v3" in out, out
    # errors: one line, exit 1
    bad = cli(env, "adapters", "rollback", name, "2", ok=False)
    assert bad.returncode == 1 and bad.stderr.startswith("loraplex: error: 409 version_not_ready") \
        and "Traceback" not in bad.stderr
    assert "deleted" in cli(env, "adapters", "delete", name).stdout
    assert cli(env, "adapters", "versions", name, ok=False).stderr.startswith("loraplex: error: 404 adapter_not_found")


def test_keys_and_config_file_profiles(stack, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f'[default]\nurl = "http://127.0.0.1:9"\napi_key = "lpx_wrong_key"\n\n'
                      f'[profiles.live]\nurl = "{stack.server.url}"\napi_key = "{stack.owner_key}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORAPLEX_")}
    env.update(LORAPLEX_CONFIG=str(config), PYTHONPATH=ROOT)
    down = cli(env, "keys", "list", ok=False)                                # [default] points nowhere
    assert down.returncode == 1 and "cannot reach http://127.0.0.1:9" in down.stderr
    created = cli(env, "keys", "create", "ci-nightly", "--profile", "live").stdout
    key = created.split(": ", 1)[1].splitlines()[0]
    assert key.startswith("lpx_") and "not shown again" in created
    rows = json.loads(cli(env, "keys", "list", "--profile", "live", "--json").stdout)
    new = next(r for r in rows if r["name"] == "ci-nightly")
    env2 = dict(env, LORAPLEX_URL=stack.server.url, LORAPLEX_API_KEY=key)     # the environment beats the file
    assert "ci-nightly" in cli(env2, "keys", "list").stdout
    assert "revoked" in cli(env, "keys", "revoke", new["id"], "--profile", "live").stdout
    gone = cli(env2, "keys", "list", ok=False)
    assert gone.returncode == 1 and "401" in gone.stderr
    missing = cli(env, "keys", "list", "--profile", "nope", ok=False)
    assert "no profile 'nope'" in missing.stderr
