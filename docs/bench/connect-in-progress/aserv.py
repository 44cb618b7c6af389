import asyncio, sys
async def handle(r, w):
    try:
        while True:
            d = await r.read(65536)
            if not d: break
            w.write(d); await w.drain()
    except ConnectionError as e:
        print("server error", e, flush=True)
    w.close()
async def main():
    s = await asyncio.start_server(handle, sys.argv[1], int(sys.argv[2]))
    async with s: await s.serve_forever()
asyncio.run(main())
