"""examples/k8s/ascend: the Deployment asks for what seed 001's does, and the start script's
flags and config file are ones `kiln serve` accepts."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "k8s" / "ascend"


def test_deployment_schedules_on_ascend_and_probes_health():
    deployment, service = yaml.safe_load_all((EXAMPLE / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert pod["schedulerName"] == "volcano"
    assert (
        container["resources"]["limits"]["huawei.com/ascend-1980"]
        == container["resources"]["requests"]["huawei.com/ascend-1980"]
    )
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert {"/usr/local/Ascend/driver", "/usr/local/Ascend/add-ons", "/etc/hccn.conf", "/model"} <= mounts
    port = container["ports"][0]["containerPort"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"] == {"path": "/health", "port": port}
    assert service["spec"]["ports"][0]["targetPort"] == port
    assert {"name": "KILN_PORT", "value": str(port)} in container["env"]


def test_start_script_is_valid_bash_and_its_config_parses():
    from kiln.cli import build_parser

    subprocess.run(["bash", "-n", str(EXAMPLE / "start_kiln.sh")], check=True)
    argv = ["serve", "/model", "--device", "npu", "--config", str(EXAMPLE / "kiln.yaml")]
    ns = build_parser(argv).parse_args(argv)
    assert (ns.device, ns.block_size, ns.max_num_seqs) == ("npu", 128, 128)
