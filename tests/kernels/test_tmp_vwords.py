import torch, pytest
import pdserve.kernels.attention as A

@pytest.mark.parametrize("dt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_words(interpreted, dt, monkeypatch):
    torch.manual_seed(0)
    B,hq,hkv,D,ps=2,8,2,128,16
    slots=B*64+32
    k=torch.randn(slots,hkv,D); v=torch.randn(slots,hkv,D)
    table=torch.randperm(slots//ps)[:B*4].view(B,4).to(torch.int32).contiguous()
    seq=torch.tensor([50,64],dtype=torch.int32)
    q=torch.randn(B,hq,D,dtype=torch.bfloat16)
    kc,vc=k.to(dt),v.to(dt)
    outs=[]
    for flag in (False,True):
        monkeypatch.setattr(A, "V_WORDS", flag)
        o=torch.empty_like(q)
        A.decode_attention(q,kc,vc,table,seq,o,0.1,ps,2)
        outs.append(o)
    assert torch.equal(outs[0],outs[1])
