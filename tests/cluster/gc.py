"""The garbage collector's part of the store: ownerReferences, propagation policies.

Background deletion removes the owner at once and its dependents on the next loop turn;
Foreground marks the owner (finalizer foregroundDeletion) until its dependents are gone;
Orphan removes the owner's reference from its dependents. An object created with owners
that do not exist is collected too, as a real cluster does.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

Obj = dict[str, Any]


class GarbageCollection:
    """Mixed into Store; uses its objects, types, delete() and patch()."""

    objects: dict[Any, Obj]
    types: dict[Any, Any]
    delete: Callable[..., Obj]
    patch: Callable[..., Obj]

    def _later(self, fn: Callable[..., None], *args: Any) -> None:
        """Run fn on the next loop turn, as the real garbage collector runs asynchronously."""
        try:
            asyncio.get_running_loop().call_soon(fn, *args)
        except RuntimeError:
            fn(*args)

    def _dependents(self, owner: Obj) -> list[Any]:
        uid = owner["metadata"]["uid"]
        return [k for k, o in self.objects.items()
                if any(r.get("uid") == uid for r in o["metadata"].get("ownerReferences") or ())]

    def _uid_exists(self, uid: str) -> bool:
        return any(o["metadata"]["uid"] == uid for o in self.objects.values())

    def _collect(self, owner_uid: str) -> None:
        """Delete the dependents whose owners are all gone."""
        for key in [k for k, o in self.objects.items()
                    if any(r.get("uid") == owner_uid for r in o["metadata"].get("ownerReferences") or ())]:
            refs = self.objects[key]["metadata"]["ownerReferences"]
            if not any(self._uid_exists(r.get("uid")) for r in refs):
                self._delete_key(key)

    def _collect_orphan(self, rtype: Any, key: Any) -> None:
        obj = self.objects.get(key)
        refs = (obj or {}).get("metadata", {}).get("ownerReferences") or ()
        if obj is not None and refs and not any(self._uid_exists(r.get("uid")) for r in refs):
            self._delete_key(key)

    def _foreground(self, rtype: Any, key: Any) -> None:
        owner = self.objects.get(key)
        if owner is None:
            return
        for dep in self._dependents(owner):
            self._delete_key(dep)
        self.patch(rtype, key[1], key[2], lambda o: _drop_finalizer(o, "foregroundDeletion"))

    def _orphan(self, owner_uid: str) -> None:
        for key, obj in list(self.objects.items()):
            refs = obj["metadata"].get("ownerReferences") or []
            if any(r.get("uid") == owner_uid for r in refs):
                rtype = self._type_for_key(key[0])
                self.patch(rtype, key[1], key[2], lambda o: _drop_owner(o, owner_uid))

    def _type_for_key(self, key: tuple[str, str]) -> Any:
        return next(t for t in self.types.values() if t.key == key)

    def _delete_key(self, key: Any) -> None:
        if key in self.objects:
            self.delete(self._type_for_key(key[0]), key[1], key[2])


def _drop_finalizer(obj: Obj, name: str) -> Obj:
    obj["metadata"]["finalizers"] = [f for f in obj["metadata"].get("finalizers") or () if f != name]
    return obj


def _drop_owner(obj: Obj, uid: str) -> Obj:
    obj["metadata"]["ownerReferences"] = [r for r in obj["metadata"]["ownerReferences"] if r.get("uid") != uid]
    return obj
