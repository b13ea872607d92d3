"""Tenants: who is calling, what they may use, and how much (docs/tenancy.md).

A tenants file (JSON, or YAML of the same shape) maps API keys to tenants:

    {"tenants": {"acme": {"api_keys": ["sk-acme-1"], "weight": 3, "max_running_requests": 8,
                          "max_queued_requests": 16, "regions": ["eu"]},
                 "beta": {"api_keys": ["sk-beta-1"], "weight": 1, "max_queued_requests": 2,
                          "output_tokens_per_minute": 20000}}}

Keys are compared in constant time (every key of the table, whatever matches first, so the
time says nothing about which tenant or how many keys) and never logged or shown: a Tenant's
repr leaves them out. Without a file, one tenant named DEFAULT_TENANT holds the single
`--api-key` (or none: open access), so one code path serves both.
"""

from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from mci.errors import UserError

DEFAULT_TENANT = "default"
LIST_FIELDS = {"api_keys", "models", "regions", "pools"}
NAME_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.")


@dataclass(frozen=True)
class Tenant:
    """One tenant's identity, share and limits (None: no limit of that kind)."""

    name: str
    api_keys: tuple[str, ...] = field(default=(), repr=False)
    weight: float = 1.0  # its share of the engine under --schedule-policy fair
    priority: int = 0  # an outer class before fairness: lower runs first, as request priority
    max_running_requests: int | None = None  # requests of it in the running batch at once
    max_queued_requests: int | None = None  # of it waiting beyond those (429 past it)
    input_tokens_per_minute: int | None = None  # prompt tokens admitted per minute
    output_tokens_per_minute: int | None = None  # tokens generated per minute
    models: tuple[str, ...] = ()  # served model names it may use (empty: all)
    regions: tuple[str, ...] = ()  # replica regions its requests may go to (empty: any)
    pools: tuple[str, ...] = ()  # replica pools it may use (empty: any; a dedicated pool)

    def __post_init__(self):
        where = f"tenant {self.name!r}"
        if not self.name or not set(self.name) <= NAME_CHARS or len(self.name) > 64:
            raise UserError(f"{where}: a name is 1-64 of [A-Za-z0-9_.-]")
        if not self.weight > 0:
            raise UserError(f"{where}: weight must be > 0")
        for name in (
            "max_running_requests",
            "max_queued_requests",
            "input_tokens_per_minute",
            "output_tokens_per_minute",
        ):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or value < (name != "max_queued_requests")
            ):
                raise UserError(f"{where}: {name} must be a whole number >= 1")
        if not all(isinstance(k, str) and k for k in self.api_keys):
            raise UserError(f"{where}: api_keys must be non-empty strings")

    def allows_model(self, model: str) -> bool:
        return not self.models or model in self.models


class TenantTable:
    """All tenants, and which key is whose. `open`: no key is needed (no file, no --api-key):
    every request is the default tenant's."""

    def __init__(self, tenants: list[Tenant], open_access: bool = False):
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise UserError("tenants file: a tenant is named twice")
        self.tenants = {t.name: t for t in tenants}
        self.open = open_access
        self._keys = [(k.encode(), t) for t in tenants for k in t.api_keys]
        if len({k for k, _ in self._keys}) != len(self._keys):
            raise UserError("tenants file: an API key is given to two tenants (or twice)")
        if not open_access and not self._keys:
            raise UserError("tenants file: no tenant has an API key")

    @classmethod
    def single(cls, api_key: str | None) -> TenantTable:
        """The one-tenant table of `--api-key KEY` (or of none: open access)."""
        keys = (api_key,) if api_key else ()
        return cls([Tenant(DEFAULT_TENANT, api_keys=keys)], open_access=not api_key)

    @classmethod
    def load(cls, path: Path) -> TenantTable:
        """Read a tenants file; a one-line UserError says what is wrong with it."""
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise UserError(f"tenants file {path}: {exc.strerror or exc}") from None
        try:
            if Path(path).suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as exc:  # noqa: BLE001 - any parse error is the file's
            # the parser's first line only: the rest quotes the file, keys and all
            exc = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise UserError(
                f"tenants file {path}: not valid {Path(path).suffix[1:] or 'JSON'}: {exc}"
            ) from None
        return cls.from_dict(data, str(path))

    @classmethod
    def from_dict(cls, data, where: str = "tenants file") -> TenantTable:
        if not isinstance(data, dict) or not isinstance(data.get("tenants"), dict):
            raise UserError(f'{where}: expected {{"tenants": {{NAME: {{...}}, ...}}}}')
        known = {f.name for f in fields(Tenant)} - {"name"}
        tenants = []
        for name, entry in data["tenants"].items():
            if not isinstance(entry, dict):
                raise UserError(f"{where}: tenant {name!r} must be an object")
            unknown = set(entry) - known
            if unknown:
                raise UserError(
                    f"{where}: tenant {name!r}: unknown field(s) {', '.join(sorted(unknown))}"
                )
            for key in LIST_FIELDS & set(entry):
                value = entry[key]
                # a bare string would be taken letter by letter: every character a key
                if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                    raise UserError(f"{where}: tenant {name!r}: {key} must be a list of strings")
            values = {k: tuple(v) if isinstance(v, list) else v for k, v in entry.items()}
            try:
                tenants.append(Tenant(name=str(name), **values))
            except TypeError as exc:
                raise UserError(f"{where}: tenant {name!r}: {exc}") from None
        return cls(tenants)

    def resolve(self, api_key: str | None) -> Tenant | None:
        """The tenant whose key this is (None: unknown, a 401). Every key is compared, in
        constant time each, whatever matches."""
        if self.open:
            return self.tenants[DEFAULT_TENANT]
        given = (api_key or "").encode()
        found = None
        for key, tenant in self._keys:
            if hmac.compare_digest(given, key) and found is None:
                found = tenant
        return found

    def names(self) -> list[str]:
        return sorted(self.tenants)


def bearer_token(authorization: str | None) -> str | None:
    """The KEY of an `Authorization: Bearer KEY` header."""
    if authorization and authorization[:7].lower() == "bearer ":
        return authorization[7:]
    return None
