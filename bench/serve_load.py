"""A fixed streaming load against an OpenAI-compatible server: the prompts of a JSONL file
(`{"prompt": ...}` per line), each sent as a chat request (T = 0, `max_tokens` tokens,
`stream: true`) by `concurrency` clients; one JSON object out: output tokens/s over the
wall time, time to first token and inter-token latency percentiles, and τ where the server
reports `speculative_decoding` (dflash-rs).

    python3 bench/serve_load.py http://127.0.0.1:8000 PROMPTS.jsonl --concurrency 4 \
        [--requests 32] [--max-tokens 128] [--model NAME]

Standard library only. Inter-token latency: each chunk's gap to the one before, shared by the
tokens it carries (a speculative round sends several at once).
"""
import argparse
import http.client
import json
import statistics
import threading
import time
import urllib.parse


def one_request(url, model, prompt, max_tokens):
    u = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    t0 = time.perf_counter()
    conn.request("POST", "/v1/chat/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        raise SystemExit(f"HTTP {r.status}: {r.read()[:300]!r}")
    ttft, last, gaps, chunks, usage, spec = None, None, [], 0, None, None
    buf = b""
    while True:
        line = r.readline()
        if not line:
            break
        line = line.strip()
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        if data == b"[DONE]":
            break
        ev = json.loads(data)
        if ev.get("usage"):
            usage = ev["usage"]
        if ev.get("speculative_decoding"):
            spec = ev["speculative_decoding"]
        choices = ev.get("choices") or []
        if not choices or not (choices[0].get("delta") or {}).get("content"):
            continue
        now = time.perf_counter()
        chunks += 1
        if ttft is None:
            ttft = now - t0
        else:
            gaps.append(now - last)
        last = now
    conn.close()
    tokens = usage["completion_tokens"] if usage else chunks
    # a chunk's gap shared by its tokens beyond the first chunk
    per_token = []
    if gaps:
        share = max(tokens - 1, len(gaps)) / len(gaps)
        for g in gaps:
            per_token += [g / share] * round(share)
    return {"tokens": tokens, "ttft": ttft or 0.0, "itl": per_token, "spec": spec,
            "secs": time.perf_counter() - t0}


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("url")
    ap.add_argument("prompts")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    prompts = [json.loads(l)["prompt"] for l in open(a.prompts) if l.strip()]
    jobs = [prompts[i % len(prompts)] for i in range(a.requests)]
    results, lock = [], threading.Lock()

    def worker(k):
        for i in range(k, len(jobs), a.concurrency):
            r = one_request(a.url, a.model, jobs[i], a.max_tokens)
            with lock:
                results.append(r)

    # one request first, outside the timing: the server's first-request costs
    one_request(a.url, a.model, jobs[0], 8)
    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(a.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    ttft = [r["ttft"] for r in results]
    specs = [r["spec"] for r in results if r["spec"]]
    rounds = sum(s["rounds"] for s in specs)
    out = {
        "concurrency": a.concurrency, "requests": len(results), "max_tokens": a.max_tokens,
        "output_tokens": tokens, "wall_s": round(wall, 3),
        "output_tok_s": round(tokens / wall, 2),
        "ttft_p50_ms": round(1000 * pct(ttft, 50), 1), "ttft_p99_ms": round(1000 * pct(ttft, 99), 1),
        "itl_p50_ms": round(1000 * pct(itl, 50), 2) if itl else None,
        "itl_p99_ms": round(1000 * pct(itl, 99), 2) if itl else None,
        "tau": round(sum(s["tau"] * s["rounds"] for s in specs) / rounds, 3) if rounds else None,
        "ttft_mean_ms": round(1000 * statistics.mean(ttft), 1),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
