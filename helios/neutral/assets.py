"""System One image assets (api.md "System One decisions"): named PNG/JPEG images a request's
strings refer to by name.

The protocol (helios/protocols/assets.py) replaces each reference with `asset_marker(k)`, a
private-use marker the scorer's prompt keeps as text until `split_assets` turns it into an
ImagePart of the neutral conversation, so the image is lowered (decoded, costed, placed) like any
other protocol's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from helios.neutral.conversation import ImagePart, TextPart

ASSET_MEDIA = {b"\x89PNG\r\n\x1a\n": "image/png", b"\xff\xd8\xff": "image/jpeg"}
_MARK = "\ue010{}\ue011"
_MARKED = re.compile("\ue010(\\d+)\ue011")


@dataclass
class Asset:
    name: str
    data: bytes
    media_type: str


def asset_marker(index: int) -> str:
    """The text that stands for asset `index` in the scorer's prompt."""
    return _MARK.format(index)


def split_assets(text: str, assets: list[Asset]) -> list[TextPart | ImagePart]:
    """A prompt text's parts: text between markers, an ImagePart per marker."""
    parts: list[TextPart | ImagePart] = []
    at = 0
    for match in _MARKED.finditer(text):
        if match.start() > at:
            parts.append(TextPart(text[at : match.start()]))
        asset = assets[int(match.group(1))]
        parts.append(ImagePart(asset.data, asset.media_type))
        at = match.end()
    if at < len(text) or not parts:
        parts.append(TextPart(text[at:]))
    return parts
