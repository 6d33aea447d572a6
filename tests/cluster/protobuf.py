"""The API server's protobuf request bodies for the built-in types `kubectl create` sends
(Secret, ConfigMap, Namespace), decoded into the JSON objects the store keeps.

kubectl's typed commands (`kubectl create secret generic`, `create configmap`, `create
namespace`) POST `application/vnd.kubernetes.protobuf`; a real API server decodes it for
every built-in type (API concepts, "Alternate representations of resources: Protobuf
encoding"): the 4-byte magic `k8s\\x00`, then a `runtime.Unknown` {typeMeta = 1 {apiVersion
= 1, kind = 2}, raw = 2 (the object's own message), contentEncoding = 3, contentType = 4}.
Field numbers below are those of k8s.io/api/core/v1/generated.proto and
k8s.io/apimachinery/pkg/apis/meta/v1/generated.proto (checked against a body kubectl
1.37 sent). Only what those commands set is decoded; any other kind raises
UnsupportedBody (the server answers 415, as a real one does for custom resources).
"""
from __future__ import annotations

import base64
from typing import Any

MAGIC = b"k8s\x00"


class UnsupportedBody(ValueError):
    """A protobuf body this emulator cannot decode (another kind, or malformed)."""


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise UnsupportedBody("truncated varint")
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    """(field number, value) pairs of one message: varints as int, length-delimited as bytes."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, i = _varint(buf, i)
            out.append((number, value))
        elif wire_type == 2:
            size, i = _varint(buf, i)
            if i + size > len(buf):
                raise UnsupportedBody("truncated field")
            out.append((number, buf[i:i + size]))
            i += size
        else:
            raise UnsupportedBody(f"wire type {wire_type} is not used by the decoded kinds")
    return out


def _text(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise UnsupportedBody("expected a string field")
    return value.decode()


def _map(entries: list[bytes], decode_value) -> dict[str, Any]:
    """A protobuf map: repeated entries {key = 1, value = 2}."""
    out = {}
    for entry in entries:
        kv = dict(fields(entry))
        out[_text(kv.get(1, b""))] = decode_value(kv.get(2, b""))
    return out


def _by_number(message: bytes) -> dict[int, list[int | bytes]]:
    """A message's fields parsed once: field number -> its values in order."""
    out: dict[int, list[int | bytes]] = {}
    for number, value in fields(message):
        out.setdefault(number, []).append(value)
    return out


def _repeated(message: dict[int, list[int | bytes]], number: int) -> list[bytes]:
    return [v for v in message.get(number, []) if isinstance(v, bytes)]


def _object_meta(raw: bytes) -> dict[str, Any]:
    """ObjectMeta: name 1, generateName 2, namespace 3, labels 11, annotations 12."""
    message = _by_number(raw)
    meta: dict[str, Any] = {}
    for number, key in ((1, "name"), (2, "generateName"), (3, "namespace")):
        values = _repeated(message, number)
        if values and values[-1]:
            meta[key] = values[-1].decode()
    for number, key in ((11, "labels"), (12, "annotations")):
        if entries := _repeated(message, number):
            meta[key] = _map(entries, _text)
    return meta


def _b64(value: int | bytes) -> str:
    if not isinstance(value, bytes):
        raise UnsupportedBody("expected a bytes field")
    return base64.b64encode(value).decode()


def _secret(raw: dict[int, list[int | bytes]]) -> dict[str, Any]:
    """Secret: metadata 1, data 2 (map<string, bytes>), type 3, stringData 4, immutable 5."""
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "Secret"}
    for number, key, decode in ((2, "data", _b64), (4, "stringData", _text)):
        if entries := _repeated(raw, number):
            obj[key] = _map(entries, decode)
    if kind := _repeated(raw, 3):
        obj["type"] = kind[-1].decode()
    return obj


def _configmap(raw: dict[int, list[int | bytes]]) -> dict[str, Any]:
    """ConfigMap: metadata 1, data 2 (map<string, string>), binaryData 3 (map<string, bytes>), immutable 4."""
    obj: dict[str, Any] = {"apiVersion": "v1", "kind": "ConfigMap"}
    for number, key, decode in ((2, "data", _text), (3, "binaryData", _b64)):
        if entries := _repeated(raw, number):
            obj[key] = _map(entries, decode)
    return obj


def _namespace(raw: dict[int, list[int | bytes]]) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace"}


_KINDS = {("v1", "Secret"): (_secret, 5), ("v1", "ConfigMap"): (_configmap, 4), ("v1", "Namespace"): (_namespace, None)}


def decode(body: bytes) -> dict[str, Any]:
    """The JSON form of a protobuf request body. Raises UnsupportedBody for another kind or a
    malformed body."""
    if not body.startswith(MAGIC):
        raise UnsupportedBody("a protobuf body starts with the magic k8s\\x00")
    unknown = dict(fields(body[len(MAGIC):]))
    type_meta = dict(fields(unknown.get(1, b"")))  # type: ignore[arg-type]
    api_version, kind = _text(type_meta.get(1, b"")), _text(type_meta.get(2, b""))
    if unknown.get(3) or (api_version, kind) not in _KINDS:
        raise UnsupportedBody(f"no protobuf codec for {api_version}/{kind} in this emulator")
    raw = unknown.get(2, b"")
    assert isinstance(raw, bytes)
    build, immutable_field = _KINDS[(api_version, kind)]
    message = _by_number(raw)
    obj = build(message)
    metas = _repeated(message, 1)
    obj["metadata"] = _object_meta(metas[-1]) if metas else {}
    flags = [v for v in message.get(immutable_field, []) if isinstance(v, int)]
    if flags:
        obj["immutable"] = bool(flags[-1])
    return obj
