"""Fixed CurveZMQ keypairs for tests (public, secret), so no test depends on what a random key
happens to look like. About 1 Z85 key in 85 starts with '-', which argparse reads as an option:
DASH_KEYS cover that case on purpose, PLAIN_KEYS the usual one."""

from __future__ import annotations

DASH_KEYS = [
    ("-IgF4BDey:TT>sU0VErXUX1rheWoowJ}x(%1)yqM", "w68PIe%F[wOLcdvVd)kB!qa+!cS4CU7t>R9wu-2."),
    ("-}=Ga+${v3}Y{.{u0#9[Or0BFt1YvZ)#W&3rKK@5", "nr6$Vb>YBgdCzG+eXBe@pN@8m2FIOu3:J@BjFxsd"),
]
PLAIN_KEYS = [
    ("wf.!G)KfDu2mOT^vjc)G[1a0r0cUpv&rC9WMz7SU", "eULA*De.8jz#KY&r^MumtJU>JI8Z^Mj]wbay+z/z"),
    ("r&7QL!(#hN^l?%1X&#p4<y-[Vq2BAq*yOWgcqCB@", "c:vK4O{hj5h/el/wdQ%s9A.kxas<ikK8](ulr>v)"),
]
SERVER_KEYS = (
    "5*u0mOT4T$v!uKvuBB}Dl}VFRf+r9uI0jG2JYO^x",
    "]^#4T=dCJnL0lh:c0qhTOM:Nd+&*&VS=T<<<7a*f",
)
