"""docs/guide.md's `bash` blocks (building and pushing the images), run line by line as written,
except that registry.example.com is a real registry (Debian's docker-registry, the CNCF
distribution registry) started here on a local port, reached over plain HTTP."""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator

import httpx
import pytest
from kube.tools import ROOT, free_port, wait_for
from kube.podman import VERSION, podman

pytestmark = pytest.mark.slow
GUIDE = ROOT / "docs" / "guide.md"
REGISTRY = "registry.example.com"


@pytest.fixture
def registry(tmp_path) -> Iterator[str]:
    """host:port of a docker-registry serving from tmp_path."""
    binary = shutil.which("docker-registry")
    assert binary, "images/install-podman.sh installs docker-registry"
    port = free_port()
    config = tmp_path / "registry.yml"
    config.write_text(f"version: 0.1\nlog: {{level: warn}}\nstorage: {{filesystem: {{rootdirectory: {tmp_path / 'data'}}}}}\n"
                      f"http: {{addr: 127.0.0.1:{port}}}\n")
    proc = subprocess.Popen([binary, "serve", str(config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        def up() -> bool:
            assert proc.poll() is None, "docker-registry exited"
            try:
                return httpx.get(f"http://127.0.0.1:{port}/v2/", timeout=2).status_code == 200
            except httpx.TransportError:
                return False
        wait_for(up, what="the registry")
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        # the pushed layers (GBs with torch's CUDA build) would stay in pytest's kept temp dirs
        shutil.rmtree(tmp_path / "data", ignore_errors=True)


def bash_lines(text: str) -> list[str]:
    return [line for body in re.findall(r"^```bash\n(.*?)^```", text, re.S | re.M)
            for line in body.splitlines() if line.strip() and not line.startswith("#")]


def test_every_image_command_of_the_user_guide_works(images, registry, capsys):
    lines = bash_lines(GUIDE.read_text())
    assert any(line.startswith("make images") for line in lines) and any(" push " in line for line in lines)
    pushed = []
    for line in lines:
        argv = shlex.split(line.replace(REGISTRY, registry))
        assert argv[0] in ("make", "images/podman.sh"), f"the guide runs a command the test does not know: {line}"
        if argv[:2] == ["images/podman.sh", "push"]:
            argv.insert(2, "--tls-verify=false")  # the local registry speaks plain HTTP
            pushed.append((argv[-2], argv[-1]))
        if argv == ["make", "images"]:
            continue  # the `images` fixture ran this exact command in this session (conftest.py)
        result = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200)
        assert result.returncode == 0, f"{line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        if argv[:2] == ["images/podman.sh", "images"]:
            assert all(tag.removeprefix("kvpilot/").replace(":", " ") in " ".join(result.stdout.split())
                       for tag in images.values()), result.stdout
    assert {local for local, _ in pushed} == set(images.values())
    for local, remote in pushed:
        repository, tag = remote.removeprefix(f"{registry}/").rsplit(":", 1)
        assert tag == VERSION
        manifest = httpx.get(f"http://{registry}/v2/{repository}/manifests/{tag}", timeout=10, headers={
            "Accept": "application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json"})
        assert manifest.status_code == 200, manifest.text
        image_id = podman("image", "inspect", "--format", "{{.Id}}", local).stdout.strip()
        assert manifest.json()["config"]["digest"] == f"sha256:{image_id}", "the registry holds the image built here"
    with capsys.disabled():
        print(f"\n[guide images] pushed {', '.join(r for _, r in pushed)} (registry.example.com = {registry})")
