"""``FracNriPlugin``'s bases (the interfaces mypy checks it against, issue
26 item 3) name exactly the NRI interfaces the class
implements and the stub hooks it offers: a handler method added without its
interface among them would escape the type check."""

from __future__ import annotations

from fracplugin.nri import interfaces
from fracplugin.nri.plugin import FracNriPlugin

HOOKS = {"abandoned": interfaces.AbandonedInterface, "may_block": interfaces.MayBlockInterface,
         "close": interfaces.CloseInterface}


def test_the_checked_interfaces_are_the_implemented_ones() -> None:
    checked = set(FracNriPlugin.__bases__)
    implemented = {s.interface for s in interfaces.EVENTS if interfaces.implements(FracNriPlugin, s)}
    hooks = {proto for attr, proto in HOOKS.items() if callable(getattr(FracNriPlugin, attr, None))}
    assert implemented  # the positive control: the class does implement NRI events
    assert checked == implemented | hooks

