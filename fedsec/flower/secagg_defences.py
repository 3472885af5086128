"""Client mods that keep a deviating SecAgg+ server from unmasking one node's upload, and the server side
of the signed rounds they need.

Flower's ``secaggplus_mod`` (Flower 1.42) answers any unmask request: it returns a self-mask-seed share for
every node the server lists as surviving and a secret-key share for every node it lists as dropped,
without checking that the two lists are disjoint, nor that they agree with what the node saw, nor that
they are the lists the other nodes were shown; and it takes the neighbours' public keys the server relays
on trust. Bonawitz et al. 2017, "Practical Secure Aggregation for Privacy-Preserving Machine Learning",
give the protocol against an active server: keys signed under a PKI, and a consistency round in which
every survivor signs the survivor list it was shown, before anything is unmasked.

* ``UnmaskListCheck``: a client mod, placed before ``secaggplus_mod`` in the ClientApp's mods. It refuses
  (an error reply, nothing revealed) an unmask request that names a node both as surviving and as
  dropped, lists this node as dropped or not as surviving, or whose lists do not name exactly the
  neighbours whose key shares reached this node, and itself. Nothing on the server changes.
* ``SignedConsistency``: the signed rounds, as a client mod before ``secaggplus_mod``. Each node holds a
  long-term ECDSA key (P-384, ``cryptography``) registered in a ``KeyDirectory`` the server cannot write;
  it signs its round keys in the setup stage and refuses neighbours' keys without a valid signature of
  their owner; in an extra consistency stage it signs the survivor list it is shown, once a round; in the
  unmask stage it answers only when at least ``quorum`` registered nodes (default: a strict majority of
  the directory) signed that same list, and when its unmask lists are its neighbourhood split by it.
  Two honest nodes can then never be shown different survivor lists (two majorities share a signer, who
  signs once), so the server cannot ask one node for a target's seed share and another for its key share.
* ``ConsistencyCheckedSecAggPlusWorkflow``: ``SecAggPlusWorkflow`` with the signed rounds (it relays the
  key signatures, runs the consistency stage before the unmask stage and relays the survivor
  signatures); the server an app with ``SignedConsistency`` runs. With Flower's own workflow, or any
  server that skips the rounds, the nodes refuse and the round halts.

What none of them stops: a server whose own (sybil) nodes hold at least the reconstruction threshold of a
target's shares (they hand the server both secrets whatever the honest nodes check), and anything outside
the protocol (the FitRes fields SecAgg+ sends in the clear). ``KeyDirectory`` is a folder of public keys:
the stand-in, in simulation, for a PKI whose roster the server does not control; a deployment passes an
object with the same three methods backed by its own PKI (Flower's SuperNode authentication keys are held
by the SuperLink, i.e. the server, and do not count).
"""
from __future__ import annotations

import os
import tempfile
from logging import ERROR
from pathlib import Path
from typing import Callable, Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.common.constant import ErrorCode
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key, Stage
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.supercore import log

# the extra stage and config keys of the signed rounds (Flower's own keys are ``Key``)
CONSISTENCY_STAGE = "fedsec_consistency_check"
KEY_SIGNATURE = "fedsec_key_signature"  # setup reply: the node's signature of its round keys
KEY_SIGNERS, KEY_SIGNATURES = "fedsec_key_signers", "fedsec_key_signatures"  # share-keys request
SURVIVORS = "fedsec_survivors"  # consistency request: the survivor list the node is shown
SURVIVORS_SIGNATURE = "fedsec_survivors_signature"  # consistency reply
SURVIVOR_SIGNERS, SURVIVOR_SIGNATURES = "fedsec_survivor_signers", "fedsec_survivor_signatures"  # unmask request
REFUSAL = "SecAgg+ refused by fedsec's client check"  # every refusal's reason starts so

_CHECK_RECORD = "fedsec_unmask_check"
_SIGNED_RECORD = "fedsec_signed_consistency"
_SIGNING_KEY_RECORD = "fedsec_signing_key"


def secagg_stage(message: Message) -> str | None:
    """The SecAgg+ stage a training message carries (None: not a SecAgg+ message)."""
    if message.metadata.message_type != MessageType.TRAIN or message.has_error():
        return None
    configs = message.content.config_records.get(RECORD_KEY_CONFIGS)
    return None if configs is None or Key.STAGE not in configs else str(configs[Key.STAGE])


def refusal(message: Message, reason: str) -> Message:
    """The error reply a checking node sends instead of its shares (nothing of its state leaves it)."""
    return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=f"{REFUSAL}: {reason}"),
                   reply_to=message)


def unmask_list_problem(node: int, sources: Iterable[int] | None, active: Iterable[int],
                        dead: Iterable[int]) -> str | None:
    """Why a node that received key shares from ``sources`` in the masking stage must not answer an unmask
    request listing ``active`` as surviving and ``dead`` as dropped (None: the lists are consistent)."""
    if sources is None:
        return "an unmask request without a masking stage this round"
    active, dead, expected = set(active), set(dead), set(sources) | {int(node)}
    both = sorted(active & dead)
    if both:
        return f"node(s) {', '.join(map(str, both))} listed both as surviving and as dropped"
    if node in dead or node not in active:
        return "this node is listed as dropped, or not as surviving"
    listed = active | dead
    if listed != expected:
        extra, missing = sorted(listed - expected), sorted(expected - listed)
        return ("the lists do not match the neighbours whose key shares reached this node"
                + (f": they name {', '.join(map(str, extra))}" if extra else "")
                + (f"; they omit {', '.join(map(str, missing))}" if missing else ""))
    return None


def _record(context: Context, name: str) -> ConfigRecord:
    if name not in context.state.config_records:
        context.state.config_records[name] = ConfigRecord({})
    return context.state.config_records[name]


class UnmaskListCheck:
    """A ClientApp mod before ``secaggplus_mod`` (``ClientApp(client_fn, mods=[UnmaskListCheck(),
    secaggplus_mod])``): refuses an unmask request whose lists are inconsistent (``unmask_list_problem``)
    with an error reply; passes every other message on unchanged."""

    def __call__(self, message: Message, context: Context, call_next: Callable) -> Message:
        stage = secagg_stage(message)
        if stage is None:
            return call_next(message, context)
        configs = message.content.config_records[RECORD_KEY_CONFIGS]  # read before secaggplus_mod pops the stage
        record = _record(context, _CHECK_RECORD)
        if stage == Stage.SETUP:
            record.clear()
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            record["sources"] = [int(s) for s in configs.get(Key.SOURCE_LIST, [])]
            record["seen"] = True
        elif stage == Stage.UNMASK:
            sources = list(record["sources"]) if record.get("seen") else None
            problem = unmask_list_problem(int(context.node_id), sources, configs[Key.ACTIVE_NODE_ID_LIST],
                                          configs[Key.DEAD_NODE_ID_LIST])
            if problem is not None:
                return refusal(message, problem)
        return call_next(message, context)


class KeyDirectory:
    """The nodes' registered signature keys (PEM public keys, one file per node id in ``folder``): a
    simulation's PKI. A node registers once; a second, different key for the same node is refused."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def _path(self, node_id: int) -> Path:
        return self.folder / f"{int(node_id)}.pem"

    def publish(self, node_id: int, public_pem: bytes) -> None:
        path = self._path(node_id)
        if path.exists():
            if path.read_bytes() != public_pem:
                raise ValueError(f"node {node_id} already registered another signature key")
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".part")
        with os.fdopen(handle, "wb") as file:
            file.write(public_pem)
        os.replace(temporary, path)

    def lookup(self, node_id: int) -> bytes | None:
        path = self._path(node_id)
        return path.read_bytes() if path.exists() else None

    def roster(self) -> list[int]:
        return sorted(int(p.stem) for p in self.folder.glob("*.pem")) if self.folder.is_dir() else []


def key_message(run_id: int, round_id: str, node: int, pk1: bytes, pk2: bytes) -> bytes:
    """What a node signs in the setup stage: its two round public keys, bound to the run, round and node."""
    return b"\x00".join([b"fedsec-secagg-keys", str(int(run_id)).encode(), round_id.encode(),
                         str(int(node)).encode(), pk1, pk2])


def survivors_message(run_id: int, round_id: str, survivors: Iterable[int]) -> bytes:
    """What a node signs in the consistency stage: the survivor list it was shown, for this run and round."""
    listed = ",".join(str(n) for n in sorted(int(s) for s in survivors))
    return b"\x00".join([b"fedsec-secagg-survivors", str(int(run_id)).encode(), round_id.encode(), listed.encode()])


def sign(private_pem: bytes, data: bytes) -> bytes:
    key = serialization.load_pem_private_key(private_pem, password=None)
    return key.sign(data, ec.ECDSA(hashes.SHA384()))


def verify(public_pem: bytes | None, data: bytes, signature: bytes) -> bool:
    if public_pem is None or not signature:
        return False
    try:
        serialization.load_pem_public_key(public_pem).verify(signature, data, ec.ECDSA(hashes.SHA384()))
    except (InvalidSignature, ValueError):
        return False
    return True


def _new_signing_key() -> tuple[bytes, bytes]:
    key = ec.generate_private_key(ec.SECP384R1())
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return private, public


class SignedConsistency:
    """A ClientApp mod before ``secaggplus_mod`` running the signed rounds of "Practical Secure Aggregation" (module
    docstring) against ``directory`` (``KeyDirectory`` or any object with ``publish``, ``lookup`` and
    ``roster``). ``quorum``: the signatures on the survivor list a node needs before it unmasks (default:
    a strict majority of the directory's roster). The server must run ``ConsistencyCheckedSecAggPlusWorkflow``."""

    def __init__(self, directory, quorum: int | None = None) -> None:
        self.directory = directory
        self.quorum = None if quorum is None else int(quorum)

    # -- the node's long-term key ----------------------------------------------------------------
    def _signing_key(self, context: Context) -> bytes:
        record = _record(context, _SIGNING_KEY_RECORD)
        if "private" not in record:
            private, public = _new_signing_key()
            record["private"], record["public"] = private, public
        self.directory.publish(int(context.node_id), bytes(record["public"]))
        return bytes(record["private"])

    def _quorum(self) -> int:
        return self.quorum if self.quorum is not None else len(self.directory.roster()) // 2 + 1

    # -- the stages --------------------------------------------------------------------------------
    def __call__(self, message: Message, context: Context, call_next: Callable) -> Message:
        stage = secagg_stage(message)
        if stage is None:
            return call_next(message, context)
        configs = message.content.config_records[RECORD_KEY_CONFIGS]
        record = _record(context, _SIGNED_RECORD)
        node, run_id, round_id = int(context.node_id), int(context.run_id), str(message.metadata.group_id)
        if stage == Stage.SETUP:
            return self._setup(message, context, call_next, record, node, run_id, round_id)
        if record.get("round") != round_id:
            return refusal(message, f"a {stage} request for round {round_id}, which this node did not set up")
        if stage == Stage.SHARE_KEYS:
            signers = [int(n) for n in configs.pop(KEY_SIGNERS, [])]
            signatures = dict(zip(signers, configs.pop(KEY_SIGNATURES, [])))
            for name in [k for k in configs.keys() if k != Key.STAGE]:
                listed = int(name)
                if listed == node:
                    continue
                pk1, pk2 = configs[name]
                if not verify(self.directory.lookup(listed), key_message(run_id, round_id, listed, pk1, pk2),
                              signatures.get(listed, b"")):
                    return refusal(message, f"the public keys relayed for node {listed} carry no valid signature "
                                            f"of its registered key")
        elif stage == Stage.COLLECT_MASKED_VECTORS:
            record["sources"] = [int(s) for s in configs.get(Key.SOURCE_LIST, [])]
            record["seen"] = True
        elif stage == CONSISTENCY_STAGE:
            return self._consistency(message, context, configs, record, node, run_id, round_id)
        elif stage == Stage.UNMASK:
            problem = self._unmask_problem(configs, record, node, run_id, round_id)
            if problem is not None:
                return refusal(message, problem)
        return call_next(message, context)

    def _setup(self, message, context, call_next, record, node, run_id, round_id) -> Message:
        last = record.get("last_round")
        if last is not None and round_id.isdigit() and str(last).isdigit() and int(round_id) <= int(last):
            return refusal(message, f"a setup for round {round_id}, not after round {last}")
        private = self._signing_key(context)
        record.clear()
        record["round"], record["last_round"] = round_id, round_id
        reply = call_next(message, context)
        if not reply.has_error():
            keys = reply.content.config_records[RECORD_KEY_CONFIGS]
            keys[KEY_SIGNATURE] = sign(private, key_message(run_id, round_id, node, keys[Key.PUBLIC_KEY_1],
                                                            keys[Key.PUBLIC_KEY_2]))
        return reply

    def _consistency(self, message, context, configs, record, node, run_id, round_id) -> Message:
        if not record.get("seen"):
            return refusal(message, "a consistency request before the masking stage")
        if record.get("signed"):
            return refusal(message, "a second survivor list this round (a node signs one)")
        survivors = sorted(int(n) for n in configs.get(SURVIVORS, []))
        if node not in survivors:
            return refusal(message, "a survivor list without this node, which sent its masked vector")
        record["survivors"], record["signed"] = survivors, True
        signature = sign(self._signing_key(context), survivors_message(run_id, round_id, survivors))
        return Message(RecordDict({RECORD_KEY_CONFIGS: ConfigRecord({SURVIVORS_SIGNATURE: signature})}),
                       reply_to=message)

    def _unmask_problem(self, configs, record, node, run_id, round_id) -> str | None:
        signers = [int(n) for n in configs.pop(SURVIVOR_SIGNERS, [])]
        signatures = list(configs.pop(SURVIVOR_SIGNATURES, []))
        if not record.get("signed"):
            return "an unmask request without a consistency round (no survivor list signed)"
        survivors = [int(n) for n in record["survivors"]]
        data = survivors_message(run_id, round_id, survivors)
        valid = {s for s, sig in zip(signers, signatures) if verify(self.directory.lookup(s), data, sig)}
        quorum = self._quorum()
        if len(valid) < quorum:
            return (f"{len(valid)} registered node(s) signed the survivor list this node signed, fewer than the "
                    f"quorum of {quorum}")
        problem = unmask_list_problem(node, record["sources"], configs[Key.ACTIVE_NODE_ID_LIST],
                                      configs[Key.DEAD_NODE_ID_LIST])
        if problem is not None:
            return problem
        neighbourhood = set(int(s) for s in record["sources"]) | {node}
        if set(configs[Key.ACTIVE_NODE_ID_LIST]) != neighbourhood & set(survivors):
            return "the unmask lists disagree with the signed survivor list"
        return None


# ------------------------------------------------------------------------------------------------
# the server side of the signed rounds


class StageGrid:
    """The grid one stage talks to, with its requests passed through ``before`` and its replies through
    ``after`` (each takes and returns the list of messages); everything else is the wrapped grid's."""

    def __init__(self, grid, before: Callable | None = None, after: Callable | None = None) -> None:
        self.grid, self.before, self.after = grid, before, after

    def __getattr__(self, name: str):
        if name == "grid":
            raise AttributeError(name)
        return getattr(self.grid, name)

    def send_and_receive(self, messages, *, timeout: float | None = None):
        messages = list(messages)
        if self.before is not None:
            messages = self.before(messages)
        replies = list(self.grid.send_and_receive(messages, timeout=timeout))
        return self.after(replies) if self.after is not None else replies


def current_round(context) -> int:
    return int(context.state.config_records[MAIN_CONFIGS_RECORD][WorkflowKey.CURRENT_ROUND])


class ConsistencyCheckedSecAggPlusWorkflow(SecAggPlusWorkflow):
    """``SecAggPlusWorkflow`` with the signed rounds ``SignedConsistency`` needs (module docstring): the
    server of an app whose ClientApp runs that mod. ``signed_rounds=False`` is Flower's workflow unchanged."""

    signed_rounds = True

    def survivors_shown(self, node: int, survivors: list[int]) -> list[int]:
        """The survivor list the consistency stage shows ``node`` (an honest server shows every node the same)."""
        return survivors

    def setup_stage(self, grid, context, state) -> bool:
        self._key_signatures: dict[int, bytes] = {}
        if not self.signed_rounds:
            return super().setup_stage(grid, context, state)

        def keep_signatures(replies):
            for reply in replies:
                if not reply.has_error():
                    configs = reply.content.config_records[RECORD_KEY_CONFIGS]
                    if KEY_SIGNATURE in configs:
                        self._key_signatures[int(reply.metadata.src_node_id)] = bytes(configs[KEY_SIGNATURE])
            return replies

        return super().setup_stage(StageGrid(grid, after=keep_signatures), context, state)

    def share_keys_stage(self, grid, context, state) -> bool:
        if not self.signed_rounds:
            return super().share_keys_stage(grid, context, state)

        def relay_signatures(messages):
            for message in messages:
                configs = message.content.config_records[RECORD_KEY_CONFIGS]
                listed = [int(k) for k in configs.keys() if k != Key.STAGE]
                configs[KEY_SIGNERS] = listed
                configs[KEY_SIGNATURES] = [self._key_signatures.get(n, b"") for n in listed]
            return messages

        return super().share_keys_stage(StageGrid(grid, before=relay_signatures), context, state)

    def unmask_stage(self, grid, context, state) -> bool:
        if not self.signed_rounds:
            return super().unmask_stage(grid, context, state)
        signatures = self.consistency_stage(grid, context, state)
        if signatures is None:
            return False

        def attach_signatures(messages):
            for message in messages:
                node = int(message.metadata.dst_node_id)
                signers = signatures.get(node, {})
                configs = message.content.config_records[RECORD_KEY_CONFIGS]
                configs[SURVIVOR_SIGNERS] = list(signers)
                configs[SURVIVOR_SIGNATURES] = list(signers.values())
            return messages

        return super().unmask_stage(StageGrid(grid, before=attach_signatures), context, state)

    def consistency_stage(self, grid, context, state) -> dict[int, dict[int, bytes]] | None:
        """Show each surviving node its survivor list, collect its signature; returns, per node, the
        signatures on the list it was shown (None: a node did not sign, and the round halts)."""
        survivors = sorted(int(n) for n in state.active_node_ids)
        shown = {node: sorted(self.survivors_shown(node, survivors)) for node in survivors}
        group = str(current_round(context))
        messages = [Message(content=RecordDict({RECORD_KEY_CONFIGS: ConfigRecord(
            {Key.STAGE: CONSISTENCY_STAGE, SURVIVORS: shown[node]})}), dst_node_id=node,
            message_type=MessageType.TRAIN, group_id=group) for node in survivors]
        replies = list(grid.send_and_receive(messages, timeout=self.timeout))
        by_list: dict[tuple, dict[int, bytes]] = {}
        for reply in replies:
            node = int(reply.metadata.src_node_id)
            if reply.has_error():
                state.failures.append(Exception(reply.error))
                continue
            signature = reply.content.config_records[RECORD_KEY_CONFIGS].get(SURVIVORS_SIGNATURE)
            if signature is not None:
                by_list.setdefault(tuple(shown[node]), {})[node] = bytes(signature)
        signed = {n for group_signatures in by_list.values() for n in group_signatures}
        if signed != set(survivors):
            log(ERROR, "SecAgg+ consistency round: %s of %s survivors signed; halting", len(signed), len(survivors))
            return None
        return {node: by_list.get(tuple(shown[node]), {}) for node in survivors}
