"""Typed transport options (tox env py): each built-in transport parses its options into a
frozen dataclass; a misspelt or mistyped option is refused, naming the valid ones,
before the transport binds to the rendezvous or an engine registers anything."""

from __future__ import annotations

import pytest

from p2psync.engine.endpoint import EngineEndpoint
from p2psync.core.errors import OptionsError
from p2psync.core.plugins import registry
from p2psync.trainer.session import Session

BUILT_IN = ("mooncake", "nixl", "samehost", "torchdist")


class Untouchable:
    """A rendezvous that fails the test if anything uses it."""

    job_id = "untouchable"
    timeout = 1.0

    def __getattr__(self, name):
        raise AssertionError(f"the rendezvous was used ({name}) before the options were checked")


class Source:
    def sender_group(self):
        raise AssertionError("the source was used before the options were checked")


@pytest.mark.parametrize("name", BUILT_IN)
def test_defaults_parse_into_the_declared_dataclass(name):
    cls = registry().transport(name)
    transport = cls()
    assert isinstance(transport.options, cls.Options)
    assert transport.options == cls.Options()


def test_given_options_reach_the_transport():
    mooncake = registry().transport("mooncake")(options={"host": "127.1.2.3", "protocol": "tcp"})
    assert (mooncake.host, mooncake.protocol) == ("127.1.2.3", "tcp")
    torchdist = registry().transport("torchdist")(options={"connect_timeout": 7})
    assert torchdist.options.connect_timeout == 7
    nixl = registry().transport("nixl")(options={"ucx_net_devices": "lo", "memory": "DRAM"})
    assert (nixl.backend_params, nixl.memory) == ({"ucx_devices": "lo"}, "DRAM")


def test_an_unknown_transport_option_is_refused_before_the_session_binds():
    with pytest.raises(OptionsError) as error:
        Session(source=Source(), transport="mooncake", rendezvous=Untouchable(), transport_options={"hots": "x"})
    assert str(error.value) == (
        "transport 'mooncake': unknown option(s) ['hots']; valid options: host: str | NoneType = None, "
        "protocol: str = 'auto', device_name: str = '', log_level: str = 'WARNING', conceal: bool | 'auto' = 'auto'"
    )


@pytest.mark.parametrize(
    ("name", "options", "message"),
    [
        ("nixl", {"ucx_devices": "lo"}, r"'nixl': unknown option\(s\) \['ucx_devices'\]; valid options: backend: str"),
        ("nixl", {"memory": "HBM"}, r"transport 'nixl': option memory='HBM' is not 'auto' \| 'DRAM' \| 'VRAM'"),
        ("torchdist", {"connect_timeout": "10"}, r"'torchdist': option connect_timeout='10' is not float \| NoneType"),
        ("samehost", {"host": "a"}, r"transport 'samehost': unknown option\(s\) \['host'\]; valid options: none"),
    ],
)
def test_an_engine_endpoint_refuses_bad_transport_options_before_it_registers(name, options, message):
    with pytest.raises(OptionsError, match=message):
        EngineEndpoint.serve(
            transport=name, transport_options=options, engine="torch", engine_id="e", rank=0, world_size=1,
            params={}, layout_key={}, rendezvous=Untouchable(),
        )


def test_options_beside_a_transport_instance_are_refused():
    transport = registry().transport("samehost")()
    with pytest.raises(OptionsError, match="transport_options apply to a transport given by name"):
        Session(source=Source(), transport=transport, rendezvous=Untouchable(), transport_options={"a": 1})
