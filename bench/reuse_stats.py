import json,sys
T=16
def stats(path):
    d=json.load(open(path)); rs=d['requests']
    by={(r['session'],r['turn']):r for r in rs}
    ttft=[]; cached=0; prompt=0; ideal=0
    for r in rs:
        if r['turn']<1 or r['error']: continue
        p=by.get((r['session'],r['turn']-1))
        ttft.append(r['ttft_ms']); prompt+=r['prompt_tokens']; cached+=r['cached_tokens'] or 0
        seen=p['prompt_tokens']+p['completion_tokens']-1
        ideal+=min(seen, r['prompt_tokens']-1)//T*T
    ttft.sort()
    q=lambda f: ttft[min(len(ttft)-1,int(f*len(ttft)))]
    return len(ttft), q(0.5), q(0.9), cached, prompt, ideal
for path in sys.argv[1:]:
    n,p50,p90,c,p,i=stats(path)
    print(f"{path}: turns>=2 n={n} TTFT p50 {p50:.1f} ms p90 {p90:.1f} ms; cached {c}/{p} prompt tokens = {c/p*100:.1f}%; ideal {i} ({i/p*100:.1f}%); reuse/ideal {c/max(i,1)*100:.1f}%")
