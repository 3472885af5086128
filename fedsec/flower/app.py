"""A Flower app directory as fedsec reads it: its ``pyproject.toml`` (``[tool.flwr.app]`` components and
run config, the local simulation federation's node count, the ``[tool.fedsec]`` table) and its
ServerApp and ClientApp objects, loaded the way ``flwr run`` loads them (the app directory first on
``sys.path``)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from fedecouple.errors import UserError

try:
    import tomllib
except ImportError:  # Python 3.10: Flower depends on tomli, the same parser
    import tomli as tomllib

FLOWER_TABLE = "[tool.flwr.app.components] serverapp and clientapp"


@dataclass
class FlowerApp:
    directory: Path
    project: dict  # the parsed pyproject.toml
    serverapp: str  # "module:attribute" references, as in [tool.flwr.app.components]
    clientapp: str
    default_run_config: dict = field(default_factory=dict)  # [tool.flwr.app.config], flattened
    num_supernodes: int | None = None  # options.num-supernodes of the default federation, if declared
    fedsec: dict = field(default_factory=dict)  # the [tool.fedsec] table

    @property
    def name(self) -> str:
        return str(self.project.get("project", {}).get("name", self.directory.name))

    def run_config(self, overrides: dict | None = None) -> dict:
        """The app's run config with ``overrides`` (flat ``key: value``) applied, as ``flwr run --run-config``
        fuses them; an override of a key the app does not have is refused."""
        from flwr.common.config import fuse_dicts

        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(self.default_run_config))
        if unknown:
            raise UserError(f"{self.directory} has no run-config key {', '.join(unknown)}; its keys: "
                            f"{', '.join(self.default_run_config) or 'none'}")
        return dict(fuse_dicts(dict(self.default_run_config), overrides))

    def load(self, which: str):
        """The app's ServerApp (``which="serverapp"``) or ClientApp object."""
        from flwr.supercore.object_ref import load_app

        reference = self.serverapp if which == "serverapp" else self.clientapp
        try:
            return load_app(reference, UserError, self.directory)
        except UserError as exc:
            raise UserError(f"{self.directory}: cannot load {which} {reference!r}: "
                            f"{str(exc).splitlines()[0]}") from None
        except ImportError as exc:
            raise UserError(f"{self.directory}: cannot import {which} {reference!r} ({exc}); "
                            f"install the app's dependencies") from None


def _num_supernodes(project: dict) -> int | None:
    federations = project.get("tool", {}).get("flwr", {}).get("federations", {})
    default = federations.get("default")
    options = (federations.get(default) or {}).get("options", {}) if isinstance(default, str) else {}
    value = options.get("num-supernodes")
    return int(value) if isinstance(value, int) else None


def read_app(directory: str | Path) -> FlowerApp:
    """Read a Flower app directory; a one-line UserError when it is not one."""
    from flwr.common.config import flatten_dict, validate_fields_in_config

    directory = Path(directory).absolute()
    pyproject = directory / "pyproject.toml"
    if not directory.is_dir():
        raise UserError(f"{directory} is not a directory; pass the directory of a Flower app (its pyproject.toml "
                        f"declares {FLOWER_TABLE})")
    if not pyproject.is_file():
        raise UserError(f"{directory} has no pyproject.toml; pass the directory of a Flower app (its pyproject.toml "
                        f"declares {FLOWER_TABLE})")
    try:
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise UserError(f"{pyproject} is not valid TOML ({exc}); fix the file") from None
    components = project.get("tool", {}).get("flwr", {}).get("app", {}).get("components")
    if not isinstance(components, dict) or not {"serverapp", "clientapp"} <= set(components):
        raise UserError(f"{pyproject} declares no Flower components; add {FLOWER_TABLE} "
                        f"(e.g. serverapp = \"pkg.server_app:app\")")
    valid, errors, _ = validate_fields_in_config(project)
    if not valid:
        raise UserError(f"{pyproject} is not a valid Flower app: {'; '.join(errors)}")
    flwr_app = project["tool"]["flwr"]["app"]
    try:
        run_config = flatten_dict(flwr_app.get("config", {}))
    except ValueError as exc:
        raise UserError(f"{pyproject} [tool.flwr.app.config]: {exc}") from None
    return FlowerApp(directory, project, str(components["serverapp"]), str(components["clientapp"]),
                     dict(run_config), _num_supernodes(project), dict(project.get("tool", {}).get("fedsec", {})))


def parse_run_config(items: tuple[str, ...] | list[str]) -> dict:
    """``--run-config`` values (``key=value`` pairs, TOML values, as for ``flwr run``) → flat overrides."""
    from flwr.common.config import parse_config_args

    malformed = [token for item in items for token in str(item).split() if "=" not in token]
    try:
        if malformed:  # Flower's parser drops such tokens without a word
            raise ValueError(malformed)
        return dict(parse_config_args(list(items)))
    except Exception:  # Flower raises click.ClickException or tomli's errors with multi-line messages
        raise UserError(f"--run-config expects space-separated key=value pairs with TOML values, e.g. "
                        f"'lr=0.1 arch=\"cnn28-same\"'; got {' '.join(items)!r}") from None
