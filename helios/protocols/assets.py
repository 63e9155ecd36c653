"""System One's `assets` field (api.md "System One decisions"): named PNG/JPEG images the
request's strings refer to by name.

`bind_assets` resolves each asset's bytes (its multipart part, else its data_base64), then
replaces references in the request's string values (state, questions; never keys): a string that
is exactly an asset name first, then nonoverlapping left-to-right occurrences of names inside
strings. A reference becomes helios.neutral.assets' marker, which the scorer lowers to an image.
"""

from __future__ import annotations

import base64
import binascii
import re
from typing import Any

from helios.neutral.assets import ASSET_MEDIA, Asset, asset_marker
from helios.neutral.errors import RequestError


def bind_assets(body: dict[str, Any], parts: dict[str, bytes]) -> list[Asset]:
    """The request's assets (their references in `body` replaced by markers, in place)."""
    raw = body.pop("assets", None)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise RequestError('assets must be an object of named assets ({"data_base64": ...})', param="assets")
    for name in parts:
        if name not in raw:
            raise RequestError(f"multipart part {name!r} belongs to no asset", param="assets")
    assets = []
    for name, spec in raw.items():
        if not name:
            raise RequestError("asset names must be nonempty", param="assets")
        if name in parts:
            data = parts[name]
        elif isinstance(spec.get("data_base64"), str):
            try:
                data = base64.b64decode(spec["data_base64"], validate=True)
            except (binascii.Error, ValueError):
                raise RequestError(f"asset {name!r}: data_base64 is not valid base64", param="assets") from None
        else:
            raise RequestError(f"asset {name!r} has neither a multipart part nor data_base64", param="assets")
        media = next((m for magic, m in ASSET_MEDIA.items() if data.startswith(magic)), None)
        if media is None:
            raise RequestError(f"asset {name!r} is not a PNG or JPEG image", param="assets")
        assets.append(Asset(name, data, media))
    used: set[int] = set()
    # Longer names first, so a name inside another name never steals its match.
    order = sorted(range(len(assets)), key=lambda k: -len(assets[k].name))
    pattern = re.compile("|".join(re.escape(assets[k].name) for k in order)) if assets else None
    index = {asset.name: k for k, asset in enumerate(assets)}

    def replace(value: Any) -> Any:
        if isinstance(value, str) and pattern is not None:
            if value in index:
                used.add(index[value])
                return asset_marker(index[value])

            def mark(match: re.Match[str]) -> str:
                used.add(index[match.group(0)])
                return asset_marker(index[match.group(0)])

            return pattern.sub(mark, value)
        if isinstance(value, dict):
            return {key: replace(item) for key, item in value.items()}
        if isinstance(value, list):
            return [replace(item) for item in value]
        return value

    for key in ("state", "questions"):
        if key in body:
            body[key] = replace(body[key])
    unused = [assets[k].name for k in range(len(assets)) if k not in used]
    if unused:
        raise RequestError(f"assets {unused} are not referenced by the state or the questions", param="assets")
    return assets
