import re, collections, sys
lines = open(sys.argv[1]).read().splitlines()
lo, hi = int(sys.argv[2], 16), int(sys.argv[3], 16)
ops = collections.Counter(); full = collections.Counter()
for l in lines:
    m = re.match(r"\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", l)
    if m and lo <= int(m.group(1), 16) <= hi:
        ops[m.group(3).split(".")[0]] += 1
        full[m.group(3)] += 1
print(sum(ops.values())); print(ops.most_common(30)); print([kv for kv in full.most_common() if kv[0].startswith(("LD", "ST", "F2F", "HMUL", "PRMT", "LOP3"))])
