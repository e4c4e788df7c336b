"""How far torch.optim.Muon (bfloat16 Newton-Schulz, torch's default) + AdamW end after 100 steps
when the same batch's gradient is computed whole or as the mean of two half-batch gradients (what
two data-parallel ranks reduce): the model and data of tests/dist/muon_dist_test.cpp's MuonParity.
The relative difference of the parameters is torch's own sensitivity to the rounding of the
gradient's sum, the reason that test bounds N > 1 against the ranks' reduced gradients.
  python tests/python/muon_bf16_sensitivity.py   (the pip platform's Python: torch >= 2.9)"""
import math

import torch
torch.set_num_threads(1)
V,D,H,T,S=11,8,12,5,12
def closed(i, shape):
    n=math.prod(shape); k=torch.arange(n,dtype=torch.float64)
    return (0.5*torch.sin(0.37*k+i)).reshape(shape)
names=[("embed",(V,D)),("wq",(D,D)),("wk",(D,D)),("wv",(D,D)),("wo",(D,D)),("ln_g",(D,)),("ln_b",(D,)),("w1",(H,D)),("b1",(H,)),("w2",(D,H)),("head",(V,D)),("temperature",())]
def make(dtype):
    P={}
    for i,(n,s) in enumerate(names):
        t=closed(i,s)
        if n in("ln_g","temperature"): t=t*0.2+1.0
        P[n]=t.to(dtype).requires_grad_(True)
    return P
def loss(P,step,lo,hi):
    tot=0
    for i in range(lo,hi):
        tok=[(step*7+i*3+t*5)%V for t in range(T)]; tg=[(x*2+1+i)%V for x in tok]
        x=P["embed"][torch.tensor(tok)]
        q=x@P["wq"].T;k=x@P["wk"].T;v=x@P["wv"].T
        a=torch.softmax(q@k.T/math.sqrt(D),-1); x=x+(a@v)@P["wo"].T
        mu=x.mean(-1,keepdim=True); var=((x-mu)**2).mean(-1,keepdim=True)
        x=(x-mu)/(var+1e-5).sqrt()*P["ln_g"]+P["ln_b"]
        x=x+torch.tanh(x@P["w1"].T+P["b1"])@P["w2"].T
        lg=(x@P["head"].T)*P["temperature"]
        tot=tot-torch.log_softmax(lg,-1).gather(1,torch.tensor(tg).unsqueeze(1)).mean()
    return tot/(hi-lo)
def run(split):
    P=make(torch.float32)
    mat=[P[n] for n in ("wq","wk","wv","wo","w1","w2")]
    oth=[P[n] for n in ("ln_g","ln_b","b1","temperature")]
    io=[P["embed"],P["head"]]
    opts=[torch.optim.Muon(mat,lr=0.02), torch.optim.AdamW(oth,lr=0.02,weight_decay=0.1), torch.optim.AdamW(io,lr=0.01,weight_decay=0.0)]
    for s in range(100):
        for p in P.values(): p.grad=None
        if split==1: loss(P,s,0,S).backward()
        else:
            per=S//split; gs=None
            for r in range(split):
                for p in P.values(): p.grad=None
                loss(P,s,r*per,(r+1)*per).backward()
                g=[p.grad.clone() for p in P.values()]
                gs=g if gs is None else [a+b for a,b in zip(gs,g)]
            for p,g in zip(P.values(),gs): p.grad=g/split
        for o in opts: o.step()
    return {k:v.detach().double() for k,v in P.items()}
a = run(1)
b = run(2)
off=sum(((a[k]-b[k])**2).sum() for k in a); nrm=sum((a[k]**2).sum() for k in a)
print("torch itself, full batch vs mean of 2 halves, bf16 NS, 100 steps: relative", math.sqrt(off/nrm))
