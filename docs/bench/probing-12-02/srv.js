// A Node.js http server (libuv's epoll loop): GET /big sends BIG, a POST answers its byte count
// and the first 16 hex digits of its SHA-256, anything else "hello".
const http = require('http'), fs = require('fs'), crypto = require('crypto');
const big = fs.readFileSync(process.env.BIG);
http.createServer((q, r) => {
  if (q.url === '/big') return r.end(big);
  if (q.method === 'POST') {
    let n = 0; const h = crypto.createHash('sha256');
    q.on('data', d => { n += d.length; h.update(d); });
    q.on('end', () => r.end(n + ' ' + h.digest('hex').slice(0, 16)));
    return;
  }
  r.end('hello\n');
}).listen(8080, '10.214.0.2');
