import re, collections, sys
s = open(sys.argv[1]).read()
lines = [l for l in s.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", l)]
addr = lambda l: int(re.match(r"\s+/\*([0-9a-f]+)\*/", l).group(1), 16)
for l in lines:
    m = re.search(r"BRA (0x[0-9a-f]+)", l)
    if m and int(m.group(1), 16) < addr(l):
        lo, hi = int(m.group(1), 16), addr(l)
body = [l for l in lines if lo <= addr(l) <= hi]
ops = collections.Counter(re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", l).group(1) for l in body)
print(len(body), sorted(ops.items(), key=lambda t: -t[1]))
