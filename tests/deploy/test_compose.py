"""docker-compose.yml and deploy/Dockerfile, validated statically (no Docker engine runs on these machines;
the README says so): every image pinned, every dependency waits for a health check, the TrainGuard
services' commands are real `trainguard` subcommands, every TRAINGUARD_* variable is a real setting with a
valid value, published ports match the ports the commands bind, and the Dockerfile installs extras that
exist from paths that exist."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict

import pytest
import tomllib
import yaml

from trainguard_server.cli import build_parser
from trainguard_server.config import Settings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE: Dict[str, Any] = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
SERVICES: Dict[str, Any] = COMPOSE["services"]
TRAINGUARD = {name for name, svc in SERVICES.items() if svc.get("build", {}).get("dockerfile") == "deploy/Dockerfile"}
FLINK = {name for name, svc in SERVICES.items()
         if svc.get("build", {}).get("dockerfile") == "deploy/flink/Dockerfile"}
DOCKERFILE = (ROOT / "deploy" / "Dockerfile").read_text()
FLINK_DOCKERFILE = (ROOT / "deploy" / "flink" / "Dockerfile").read_text()


def test_the_stack_has_the_designs_parts() -> None:
    assert {"kafka", "elasticsearch", "clickhouse", "postgres"} <= set(SERVICES)
    assert TRAINGUARD == {"gateway", "processor", "api"}
    assert FLINK == {"flink-jobmanager", "flink-taskmanager"}


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_every_image_is_pinned_to_a_version(name: str) -> None:
    image = SERVICES[name]["image"]
    repo, _, tag = image.rpartition(":")
    assert repo and re.fullmatch(r"\d+(\.\d+)+(-[\w.]+)?", tag), image


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_dependencies_wait_for_health_checks_that_exist(name: str) -> None:
    for dep, cond in (SERVICES[name].get("depends_on") or {}).items():
        assert dep in SERVICES and cond == {"condition": "service_healthy"}, (name, dep, cond)
        check = SERVICES[dep].get("healthcheck", {}).get("test")
        assert check and check[0] in ("CMD", "CMD-SHELL"), dep


def test_infrastructure_is_health_checked_and_kafka_runs_in_kraft_mode() -> None:
    for name in ("kafka", "elasticsearch", "clickhouse", "postgres"):
        assert SERVICES[name]["healthcheck"]["test"], name
    kafka = SERVICES["kafka"]["environment"]
    assert kafka["KAFKA_PROCESS_ROLES"] == "broker,controller" and "ZOOKEEPER" not in " ".join(kafka)


@pytest.mark.parametrize("name", sorted(TRAINGUARD))
def test_trainguard_services_run_real_commands_with_real_settings(name: str, monkeypatch: Any) -> None:
    svc = SERVICES[name]
    args = build_parser().parse_args(svc["command"])
    assert args.command == name and args.roles == name
    env = svc["environment"]
    fields = set(Settings.model_fields)
    for key, value in env.items():
        assert key.startswith("TRAINGUARD_") and key[len("TRAINGUARD_"):].lower() in fields, key
        monkeypatch.setenv(key, str(value))
    if getattr(args, "processor_runtime", None):
        monkeypatch.setenv("TRAINGUARD_PROCESSOR_RUNTIME", args.processor_runtime)
    settings = Settings()  # validates every value (types, literals)
    assert (settings.queue, settings.event_store, settings.metric_store) == ("kafka", "elasticsearch", "clickhouse")
    assert settings.processor_runtime == "flink"
    assert settings.state_store == "postgres"  # shared state: no process is tied to another's data dir
    assert (svc["depends_on"] or {}).get("postgres") == {"condition": "service_healthy"}, name
    host_of = {"kafka": settings.kafka_bootstrap_servers, "elasticsearch": settings.elasticsearch_hosts,
               "clickhouse": settings.clickhouse_url, "postgres": settings.postgres_dsn}
    for dep, address in host_of.items():
        assert dep in address, (dep, address)  # the in-network service names
    for binding in svc.get("ports", []):
        _host_port, container_port = binding.split(":")
        assert container_port in svc["command"], (name, binding)
    assert any(v.endswith(":/var/lib/trainguard") for v in svc["volumes"])  # the shared SQLite data dir


def test_postgres_is_the_database_the_trainguard_services_connect_to() -> None:
    """The DSN every TrainGuard service uses names the postgres service's port, user, password and database
    (as libpq parses it), and the server keeps its data on a volume and is health-checked with pg_isready."""
    from psycopg.conninfo import conninfo_to_dict

    pg = SERVICES["postgres"]
    env = pg["environment"]
    assert env["POSTGRES_USER"] == env["POSTGRES_PASSWORD"] == env["POSTGRES_DB"] == "trainguard"
    assert any(v.endswith(":/var/lib/postgresql/data") for v in pg["volumes"])
    assert pg["volumes"][0].split(":")[0] in COMPOSE["volumes"]
    check = " ".join(pg["healthcheck"]["test"])
    assert "pg_isready" in check and f"-U {env['POSTGRES_USER']}" in check and f"-d {env['POSTGRES_DB']}" in check
    for name in TRAINGUARD:
        dsn = conninfo_to_dict(SERVICES[name]["environment"]["TRAINGUARD_POSTGRES_DSN"])
        assert (dsn["host"], dsn.get("port", "5432")) == ("postgres", "5432"), name
        assert (dsn["user"], dsn["password"], dsn["dbname"]) == (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"],
                                                                 env["POSTGRES_DB"]), name


def test_the_dockerfile_installs_what_exists() -> None:
    copies = re.findall(r"^COPY (\S+) ", DOCKERFILE, re.M)
    assert copies and all((ROOT / c).exists() for c in copies), copies
    extras = set(tomllib.loads((ROOT / "services" / "pyproject.toml").read_text())["project"]
                 ["optional-dependencies"])
    wanted = re.search(r'\./services\[([\w,]+)\]', DOCKERFILE)
    assert wanted and set(wanted.group(1).split(",")) <= extras
    # the stores docker-compose.yml selects: Kafka, Elasticsearch, ClickHouse, PostgreSQL
    assert {"kafka", "elasticsearch", "clickhouse", "postgres"} <= set(wanted.group(1).split(","))
    sdk_extras = set(tomllib.loads((ROOT / "sdk" / "pyproject.toml").read_text())["project"]
                     ["optional-dependencies"])
    assert set(re.search(r"\./sdk\[([\w,]+)\]", DOCKERFILE).group(1).split(",")) <= sdk_extras  # type: ignore[union-attr]
    scripts = tomllib.loads((ROOT / "services" / "pyproject.toml").read_text())["project"]["scripts"]
    assert 'ENTRYPOINT ["trainguard"]' in DOCKERFILE and "trainguard" in scripts
    assert re.search(r"^FROM python:3\.11[\w.-]*$", DOCKERFILE, re.M)


def test_the_flink_job_runs_our_job_with_its_real_arguments_against_the_stacks_topics() -> None:
    from trainguard_server.processor.flink_main import build_parser as job_parser

    command = SERVICES["flink-jobmanager"]["command"]
    assert command[:3] == ["standalone-job", "-pym", "trainguard_server.processor.flink_main"]
    job = job_parser().parse_args(command[3:])
    env = SERVICES["processor"]["environment"]
    assert job.kafka == env["TRAINGUARD_KAFKA_BOOTSTRAP_SERVERS"] and job.topic == env["TRAINGUARD_KAFKA_TOPIC"]
    assert job.results_topic == env["TRAINGUARD_KAFKA_RESULTS_TOPIC"]
    assert str(job.jars) == "/opt/flink/lib"  # where the image puts the connector jars
    assert SERVICES["flink-taskmanager"]["command"] == ["taskmanager"]
    props = yaml.safe_load(SERVICES["flink-jobmanager"]["environment"]["FLINK_PROPERTIES"])
    assert props["jobmanager.rpc.address"] == "flink-jobmanager" and props["parallelism.default"] >= job.parallelism


def test_the_flink_dockerfile_installs_the_pinned_flink_and_connector() -> None:
    image = re.search(r"^FROM flink:(\S+)$", FLINK_DOCKERFILE, re.M)
    pinned = [line for line in (ROOT / "requirements" / "flink.txt").read_text().splitlines()
              if line.startswith("apache-flink==")]
    assert image and pinned and image.group(1).startswith(pinned[0].split("==")[1]), (image, pinned)
    copies = re.findall(r"^COPY ((?:\S+ )+)\S+$", FLINK_DOCKERFILE, re.M)
    assert copies and all((ROOT / c).exists() for group in copies for c in group.split()), copies
    assert "tools/flink_jars.py /opt/flink/lib" in FLINK_DOCKERFILE
