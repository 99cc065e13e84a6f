import sys, time, torch, torch.nn.functional as F
from sinklab.data.synthetic import SyntheticDataModule
from sinklab.model import ModelConfig, Transformer
from sinklab.metrics import attention_scores, summarise
torch.set_num_threads(1)
def run(steps=300, n_layer=2, n_head=4, d=64, lr=3e-3, wd=0.1, op="softmax", bs=32, seed=0, every=50, **dk):
    dm = SyntheticDataModule(batch_size=bs, seed=seed, **dk).prepare()
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=dm.vocab_size, n_layer=n_layer, n_head=n_head, d_model=d, d_ff=int(d*2.75)//8*8, block_size=64, attn_op=op)
    m = Transformer(cfg)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd, betas=(0.9,0.95))
    it = iter(dm.make_train_loader())
    probe = dm.probe_tokens()
    t0=time.time(); out=[]
    for s in range(1, steps+1):
        b = next(it); x,y=b[:,:-1],b[:,1:]
        loss = F.cross_entropy(m(x).flatten(0,1), y.flatten())
        opt.zero_grad(); loss.backward(); torch.nn.utils.clip_grad_norm_(m.parameters(),1.0); opt.step()
        if s % every == 0:
            m.eval()
            sc = summarise(attention_scores(m, probe), [0.3])
            with torch.no_grad():
                pb=probe; lg=m(pb[:,:-1]); nll=F.cross_entropy(lg.flatten(0,1), pb[:,1:].flatten(), reduction='none').view(pb.shape[0],-1)
                trig=(pb[:,1:]==dm.task.n_tokens) if dm.hparams.task=='seen_flag' else torch.from_numpy(dm.task.is_trigger)[pb[:,:-1].clamp(max=dm.task.n_tokens-1)] & (pb[:,:-1]!=dm.bos_id)
                trig[:,:2]=False
                cl=nll[trig].mean().item(); ol=nll[~trig].mean().item()
            m.train()
            out.append((s, round(loss.item(),3), round(sc['sink1'],1), round(sc.get('sink1_star',-1),1), round(sc['alpha1'],3), 'copy',round(cl,2),'other',round(ol,2)))
    with torch.no_grad():
        pb=probe; _,probs=m(pb,return_probs=True)
        trig=torch.cat([pb[:,1:]==dm.task.n_tokens, torch.zeros_like(pb[:,:1],dtype=torch.bool)],1) if dm.hparams.task=='seen_flag' else torch.from_numpy(dm.task.is_trigger)[pb.clamp(max=dm.task.n_tokens-1)] & (pb!=dm.bos_id)
        for l,p in enumerate(probs):  # (N,H,T,T)
            T=p.shape[-1]; idx=torch.arange(2,T)
            bos=p[:,:,idx,0]; prev=p[:,:,idx,idx-1]; self_=p[:,:,idx,idx]
            nt=~trig[:,idx]
            print('layer',l,'nontrig bos/prev/self',[ (round(bos[:,h][nt].mean().item(),2),round(prev[:,h][nt].mean().item(),2),round(self_[:,h][nt].mean().item(),2)) for h in range(p.shape[1])],
                  'trig', [ (round(bos[:,h][~nt].mean().item(),2),round(prev[:,h][~nt].mean().item(),2)) for h in range(p.shape[1])])
    print(dict(n_layer=n_layer,n_head=n_head,d=d,lr=lr,wd=wd,op=op,seed=seed,**dk), f"{time.time()-t0:.1f}s", out, flush=True)
if __name__ == "__main__":
    for a in sys.argv[1:]:
        run(**eval(f"dict({a})"))
