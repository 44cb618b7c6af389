import asyncio, sys, time
async def one(i):
    r, w = await asyncio.open_connection(sys.argv[1], int(sys.argv[2]))
    w.write(b"x" * 100); await w.drain()
    d = await r.readexactly(100)
    return w
async def main():
    t = time.time()
    n = int(sys.argv[3])
    ws = await asyncio.gather(*(one(i) for i in range(n)), return_exceptions=True)
    errs = [w for w in ws if isinstance(w, BaseException)]
    print(n - len(errs), "ok", len(errs), "errors", set(type(e).__name__ for e in errs), round(time.time() - t, 2), "s")
    for w in ws:
        if not isinstance(w, BaseException): w.close()
asyncio.run(main())
