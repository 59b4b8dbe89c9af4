"""The listening socket `labkit serve` binds: accepted connections send small writes at once."""

import asyncio
import socket

from labkit.serve.server import bind


def test_accepted_connections_have_nagle_disabled():
    async def accepted_nodelay() -> int:
        seen = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        listener = bind("127.0.0.1", 0)
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        try:
            _, writer = await asyncio.open_connection(*listener.getsockname())
            value = await asyncio.wait_for(seen, 5)
            writer.close()
            return value
        finally:
            server.close()

    assert asyncio.run(accepted_nodelay()) != 0
