"""The container files, checked without a Docker engine.

docker-compose.yml is parsed with PyYAML (anchors and merge keys resolve as in
Compose), the Dockerfile and .dockerignore are read as text, and every command
an app service runs is parsed by the real CLI parser, so compose cannot name a
subcommand or an environment variable the CLI does not have. No database needed.
"""

import json
import os
import re
import shlex
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

yaml = pytest.importorskip("yaml")

from agent_inbox import cli  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

APP_SERVICES = ("migrate", "demo", "worker", "scheduler", "dispatcher", "ingest-server")
RUNTIME_SERVICES = ("worker", "scheduler", "dispatcher", "ingest-server")
URL_VAR = "AGENT_INBOX_DATABASE_URL"


# --- helpers -----------------------------------------------------------------

_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-+])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: str, env: dict[str, str] | None = None) -> str:
    """Compose's interpolation for the forms used here: ${VAR}, ${VAR:-default},
    ${VAR-default}, ${VAR:+replacement}, ${VAR+replacement}, $VAR and the $$
    escape. With env={} every default applies and no replacement does."""
    env = {} if env is None else env

    def sub(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1) or match.group(4)
        operator, word = match.group(2), match.group(3)
        # With a colon, an empty value counts as unset.
        present = bool(env.get(name)) if operator and operator.startswith(":") else name in env
        if operator in ("-", ":-"):
            return env[name] if present else word
        if operator in ("+", ":+"):
            return word if present else ""
        return env.get(name, "")

    return _VAR.sub(sub, value)


def environment(service: dict) -> dict[str, str]:
    """A service's environment, from either the mapping or the list form."""
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, "") for item in env)
    return {key: "" if value is None else str(value) for key, value in env.items()}


def depends_on(service: dict) -> dict[str, dict]:
    deps = service.get("depends_on") or {}
    if isinstance(deps, list):  # short form: no condition, i.e. service_started
        return {name: {"condition": "service_started"} for name in deps}
    return deps


def command_argv(service: dict) -> list[str]:
    command = service["command"]
    return shlex.split(command) if isinstance(command, str) else [str(arg) for arg in command]


def build_context(service: dict) -> str | None:
    build = service.get("build")
    if isinstance(build, dict):
        return build.get("context", ".")
    return build


def named_volumes(service: dict) -> set[str]:
    names = set()
    for mount in service.get("volumes") or []:
        if isinstance(mount, dict):
            if mount.get("type", "volume") == "volume" and mount.get("source"):
                names.add(mount["source"])
            continue
        parts = mount.split(":")
        source = parts[0] if len(parts) > 1 else None  # "/path" alone is anonymous
        if source and not source.startswith((".", "/", "~", "$")):
            names.add(source)
    return names


def mount_targets(service: dict) -> set[str]:
    targets = set()
    for mount in service.get("volumes") or []:
        if isinstance(mount, dict):
            targets.add(mount.get("target"))
        else:
            parts = mount.split(":")
            targets.add(parts[1] if len(parts) > 1 else parts[0])
    return targets


def dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, with comments dropped and continuations joined."""
    instructions, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        keyword, _, args = full.partition(" ")
        instructions.append((keyword.upper(), args.strip()))
    return instructions


def _dockerignore_regex(pattern: str) -> re.Pattern:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**", i):
            out += ".*"
            i += 2
            if pattern.startswith("/", i):
                out += "/?"
                i += 1
        elif pattern[i] == "*":
            out += "[^/]*"
            i += 1
        elif pattern[i] == "?":
            out += "[^/]"
            i += 1
        else:
            out += re.escape(pattern[i])
            i += 1
    return re.compile(out + r"\Z")


def dockerignored(path: str) -> bool:
    """Whether .dockerignore keeps `path` out of the build context: the last
    pattern matching the path or one of its parent directories decides."""
    if not DOCKERIGNORE.exists():
        return False
    parts = path.strip("/").split("/")
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for raw in DOCKERIGNORE.read_text().splitlines():
        pattern = raw.strip()
        if not pattern or pattern.startswith("#"):
            continue
        negate = pattern.startswith("!")
        pattern = os.path.normpath(pattern.lstrip("!").strip()).lstrip("/")
        regex = _dockerignore_regex(pattern)
        if any(regex.match(candidate) for candidate in candidates):
            excluded = not negate
    return excluded


# --- fixtures ------------------------------------------------------------------


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def services(compose) -> dict:
    return compose["services"]


def app_services(services: dict) -> dict:
    """Every service that runs the project's image, i.e. the agent-inbox CLI."""
    return {name: svc for name, svc in services.items() if "build" in svc}


# --- docker-compose.yml --------------------------------------------------------


def test_compose_spec_file_without_version_key(compose):
    assert "version" not in compose, "the Compose spec ignores `version:`; leave it out"
    assert isinstance(compose.get("services"), dict)


def test_services_exist(services):
    assert {"postgres", *APP_SERVICES} <= set(services)
    assert set(APP_SERVICES) <= set(app_services(services))


def test_postgres_service(services):
    pg = services["postgres"]
    assert pg["image"] == "postgres:15"
    assert "/var/lib/postgresql/data" in mount_targets(pg)
    assert named_volumes(pg), "the data directory should live in a named volume"
    env = environment(pg)
    assert "POSTGRES_PASSWORD" in env
    assert interpolate(env["POSTGRES_PASSWORD"]), "POSTGRES_PASSWORD needs a default"


def test_postgres_healthcheck_uses_pg_isready(services):
    check = services["postgres"]["healthcheck"]
    test = check["test"]
    text = " ".join(test) if isinstance(test, list) else test
    assert "pg_isready" in text
    if isinstance(test, list):
        assert test[0] in ("CMD", "CMD-SHELL")


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_service_builds_from_project(services, name):
    assert build_context(services[name]) in (".", "./")
    assert (ROOT / "Dockerfile").is_file()


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_service_database_url_names_postgres(services, name):
    pg_env = {key: interpolate(value) for key, value in environment(services["postgres"]).items()}
    url = interpolate(environment(services[name])[URL_VAR])
    parts = urlsplit(url)
    assert parts.scheme in ("postgresql", "postgres")
    assert parts.hostname == "postgres"
    assert parts.port in (None, 5432)
    # The URL agrees with what the postgres service initialises, defaults included.
    assert unquote(parts.username or "") == pg_env.get("POSTGRES_USER", "postgres")
    assert unquote(parts.password or "") == pg_env["POSTGRES_PASSWORD"]
    dbname = parts.path.lstrip("/")
    assert dbname == pg_env.get("POSTGRES_DB", pg_env.get("POSTGRES_USER", "postgres"))


def test_database_url_follows_overrides(services):
    env = {"POSTGRES_USER": "u1", "POSTGRES_PASSWORD": "p1", "POSTGRES_DB": "d1"}
    for name in APP_SERVICES:
        parts = urlsplit(interpolate(environment(services[name])[URL_VAR], env))
        assert (parts.username, parts.password, parts.path) == ("u1", "p1", "/d1")
    pg = {key: interpolate(value, env) for key, value in environment(services["postgres"]).items()}
    assert (pg["POSTGRES_USER"], pg["POSTGRES_PASSWORD"], pg["POSTGRES_DB"]) == ("u1", "p1", "d1")


def test_migrate_is_one_shot_after_healthy_postgres(services):
    migrate = services["migrate"]
    assert depends_on(migrate)["postgres"]["condition"] == "service_healthy"
    assert migrate.get("restart") == "no"  # the string; a bare `no` would be YAML false
    assert command_argv(migrate)[0] == "migrate"


def test_demo_runs_after_migrate_on_request(services):
    demo = services["demo"]
    deps = depends_on(demo)
    assert deps["postgres"]["condition"] == "service_healthy"
    assert deps["migrate"]["condition"] == "service_completed_successfully"
    assert "demo" in demo.get("profiles", [])
    assert command_argv(demo)[0] == "demo"


def test_app_services_share_one_definition(compose, services):
    shared = compose.get("x-agent-inbox")
    assert isinstance(shared, dict), "the shared build + environment live in x-agent-inbox"
    for name in APP_SERVICES:
        assert services[name]["build"] == shared["build"]
        own = environment(services[name])
        assert own.items() >= environment(shared).items()  # services only add settings


def test_dependencies_name_real_services(services):
    for name, svc in services.items():
        for dep in depends_on(svc):
            assert dep in services, f"{name} depends on unknown service {dep}"
            assert dep != name


def test_named_volumes_are_declared(compose, services):
    declared = set(compose.get("volumes") or {})
    for name, svc in services.items():
        missing = named_volumes(svc) - declared
        assert not missing, f"{name} uses undeclared volumes {sorted(missing)}"


# --- the CLI behind every app service --------------------------------------------


def test_every_app_command_is_a_real_subcommand(services, monkeypatch):
    """Parse each command with the CLI's own parser, with the service's environment."""
    for name, svc in app_services(services).items():
        assert "command" in svc, f"{name} should say which subcommand it runs"
        env = {key: interpolate(value) for key, value in environment(svc).items()}
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        parser = cli.build_parser()  # option defaults read the environment here
        try:
            args = parser.parse_args(command_argv(svc))
        except SystemExit as exc:  # argparse's way of rejecting a command line
            pytest.fail(f"{name}: `agent-inbox {' '.join(command_argv(svc))}` is not a valid command ({exc})")
        assert callable(getattr(args, "run", None))
        assert args.database_url == env[URL_VAR], f"{name} does not read {URL_VAR}"


def test_an_unknown_subcommand_is_rejected():
    """The check above would be vacuous if the parser accepted anything."""
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["no-such-subcommand"])


# --- Dockerfile and .dockerignore ------------------------------------------------------


def test_dockerfile_base_install_and_entrypoint():
    instructions = dockerfile_instructions()
    froms = [args for kw, args in instructions if kw == "FROM"]
    assert froms and froms[-1].split()[0] == "python:3.11-slim"
    runs = " ".join(args for kw, args in instructions if kw == "RUN")
    assert re.search(r"""pip install\s+(\S+\s+)*["']?\.\[binary\]["']?""", runs), runs
    entrypoints = [args for kw, args in instructions if kw == "ENTRYPOINT"]
    assert entrypoints and json.loads(entrypoints[-1]) == ["agent-inbox"]


def test_dockerfile_does_not_run_as_root():
    instructions = dockerfile_instructions()
    users = [args for kw, args in instructions if kw == "USER"]
    assert users, "the image should switch to a non-root USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0")
    # The final USER comes after every RUN, so nothing later undoes it.
    last_user = max(i for i, (kw, _) in enumerate(instructions) if kw == "USER")
    assert all(kw != "RUN" for kw, _ in instructions[last_user:])


def test_entrypoint_is_the_installed_console_script():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["scripts"]["agent-inbox"] == "agent_inbox.cli:main"
    assert "binary" in project["optional-dependencies"]


def test_dockerfile_copies_what_pip_install_needs():
    """`pip install .` reads pyproject.toml, the readme it names and each package
    directory; all must be COPY'd into the image and left in the build context."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    needed = {"pyproject.toml"}
    readme = pyproject["project"].get("readme")
    if isinstance(readme, str):
        needed.add(readme)
    elif isinstance(readme, dict) and "file" in readme:
        needed.add(readme["file"])
    package_dirs = pyproject.get("tool", {}).get("setuptools", {}).get("package-dir", {})
    needed |= {path.strip("/") for path in package_dirs.values() if path}

    sources = set()
    for kw, args in dockerfile_instructions():
        if kw in ("COPY", "ADD"):
            words = [w for w in (json.loads(args) if args.startswith("[") else args.split())
                     if not w.startswith("--")]
            sources |= {w.strip("/") or "." for w in words[:-1]}

    for path in sorted(needed):
        covered = any(s in (".", "./") or path == s or path.startswith(s + "/") for s in sources)
        assert covered, f"the Dockerfile never copies {path}"
        assert not dockerignored(path), f".dockerignore keeps {path} out of the build"
        assert not dockerignored(path + "/__init__.py") or not (ROOT / path).is_dir()


def test_dockerignore_keeps_local_state_out():
    for path in (".git/HEAD", ".venv/bin/python", "tests/conftest.py",
                 "src/agent_inbox/__pycache__/cli.cpython-311.pyc"):
        assert dockerignored(path), f"{path} should not be sent to the build"


@pytest.mark.parametrize("name", RUNTIME_SERVICES)
def test_runtime_services_wait_for_the_migration_and_restart(services, name):
    svc = services[name]
    assert depends_on(svc)["migrate"]["condition"] == "service_completed_successfully"
    assert depends_on(svc)["postgres"]["condition"] == "service_healthy"
    assert svc["restart"] == "unless-stopped"


def test_workers_run_several_replicas_and_outlast_their_grace(services):
    worker = services["worker"]
    assert worker["deploy"]["replicas"] >= 2
    assert worker["stop_grace_period"] == "40s"


@pytest.mark.parametrize("name", RUNTIME_SERVICES)
def test_runtime_services_have_a_healthcheck_on_a_port_they_serve(services, name):
    svc = services[name]
    probe = " ".join(svc["healthcheck"]["test"])
    env = environment(svc)
    port = env["AGENT_INBOX_PORT"] if "/healthz" in probe else env["AGENT_INBOX_METRICS_PORT"]
    assert f"http://127.0.0.1:{port}/" in probe


def test_the_ingest_server_reads_its_secrets_from_a_declared_compose_secret(compose, services):
    svc = services["ingest-server"]
    [secret] = svc["secrets"]
    chosen = {"AGENT_INBOX_SECRETS_FILE": "./my-secrets.json"}
    assert interpolate(environment(svc)["AGENT_INBOX_SECRETS"], chosen) == f"/run/secrets/{secret}"
    assert interpolate(compose["secrets"][secret]["file"], chosen) == "./my-secrets.json"
    assert environment(svc)["AGENT_INBOX_HOST"] == "0.0.0.0"


def test_there_is_no_default_secrets_file_and_the_intake_says_so(compose, services, monkeypatch,
                                                                 capsys):
    """Unset, nothing is mounted (not the committed example, whose secrets are
    placeholders) and the intake exits 2 saying what to set, before connecting."""
    svc = services["ingest-server"]
    [secret] = svc["secrets"]
    assert interpolate(compose["secrets"][secret]["file"]) == "/dev/null"
    for key, value in environment(svc).items():
        monkeypatch.setenv(key, interpolate(value))
    assert os.environ["AGENT_INBOX_SECRETS"] == ""
    assert cli.main(command_argv(svc)) == 2
    assert "set AGENT_INBOX_SECRETS_FILE" in capsys.readouterr().err


def test_the_intake_is_published_on_the_hosts_loopback_by_default(services):
    [published] = services["ingest-server"]["ports"]
    assert interpolate(published) == "127.0.0.1:8080:8080"
    assert interpolate(published, {"AGENT_INBOX_INGEST_BIND": "0.0.0.0"}) == "0.0.0.0:8080:8080"
    for name, svc in services.items():  # nothing else reaches beyond the host
        for port in svc.get("ports") or []:
            assert interpolate(str(port)).startswith("127.0.0.1:"), (name, port)


@pytest.mark.parametrize("name", RUNTIME_SERVICES)
def test_metrics_listen_on_the_compose_network_and_are_not_published(services, name):
    env = environment(services[name])
    assert env["AGENT_INBOX_METRICS_HOST"] == "0.0.0.0"
    assert not any(env["AGENT_INBOX_METRICS_PORT"] in str(p).rsplit(":", 1)[-1]
                   for p in services[name].get("ports") or [])
