using System.Collections.Concurrent;
using System.Runtime.ExceptionServices;
using System.Threading.Channels;
using ExactlyOnce.Telemetry;
using Microsoft.Extensions.Logging;

namespace ExactlyOnce;

/// <summary>
/// The batched inbox: deliveries of one consumer that arrive together share one transaction. A batch collects up to
/// <see cref="InboxBatchingOptions.MaxBatchSize"/> deliveries while another batch of the consumer runs, for at most
/// <see cref="InboxBatchingOptions.MaxWait"/>; with none running it starts at once, and a finishing batch starts the next
/// one without waiting for the timer. Its leader task opens a connection of its own,
/// begins, claims every key in one statement, and hands the transaction to each delivery in turn: the delivery's own
/// scope context joins it, the consumer runs on the delivery's own async flow inside a savepoint, and saves. The
/// leader commits once (the claims carry their processed mark from the start); only then are the survivors told
/// "processed" and acknowledged.
/// </summary>
/// <remarks>
/// Invariants. (1) The same as the one-transaction protocol, per message: a consumer runs only while the batch owns an
/// uncommitted claim of its key, and claim and effects commit or vanish together. (2) One command at a time on the
/// shared connection: the leader waits for each turn to end before it sends anything else. (3) A failed member is
/// rolled back to its savepoint and its claim row deleted before it is told, so its retry can claim again; the others
/// go on. (4) A second copy of a key already in the open batch never enters the batch (one statement cannot claim a key
/// twice): it waits for the batch's outcome, bounded by the claim timeout, then takes the one-transaction path — a
/// duplicate if the batch committed the key, processed if it did not. (5) A claim that times out or deadlocks discards
/// nothing: a lone delivery is deferred exactly as in the one-transaction path; several fall back to that path one by
/// one. (6) A commit failure fails every member still waiting; a retrying execution strategy re-runs the whole batch
/// (minus members already answered) as one fresh transaction.
/// </remarks>
internal sealed class InboxBatcher
{
    private readonly ExactlyOnceOptions _options;
    private readonly TimeProvider _timeProvider;
    private readonly ExactlyOnceTelemetry _telemetry;
    private readonly ILogger _logger;
    private readonly ConcurrentDictionary<string, Lane> _lanes = new(StringComparer.Ordinal);

    public InboxBatcher(ExactlyOnceOptions options, TimeProvider timeProvider, ExactlyOnceTelemetry telemetry, ILogger logger)
    {
        _options = options;
        _timeProvider = timeProvider;
        _telemetry = telemetry;
        _logger = logger;
    }

    /// <summary>Processes one delivery in a batch; <paramref name="alone"/> is the one-transaction path, for the fallbacks.</summary>
    public async Task<InboxOutcome> ProcessAsync(
        IInboxBatchStore store, InboxKey key, DateTime receivedAt, Func<CancellationToken, Task> consume, Func<Task<InboxOutcome>> alone, CancellationToken cancellationToken)
    {
        Lane lane = _lanes.GetOrAdd(key.ConsumerName, static _ => new Lane());
        var member = new Member(store, key, receivedAt);
        Batch? follow = null;
        Batch? start = null;
        Batch? arm = null;
        lock (lane)
        {
            Batch open = lane.Open ??= new Batch();
            if (!open.Keys.Add(key))
            {
                follow = open;
            }
            else
            {
                open.Members.Add(member);
                // No batch of this consumer running: nothing to wait for, start at once (a lone delivery never waits).
                // Otherwise collect while the running ones work; a finishing batch starts the next, the timer caps the wait.
                if (open.Members.Count >= _options.Batching.MaxBatchSize || lane.Running == 0 || _options.Batching.MaxWait == TimeSpan.Zero)
                {
                    start = TakeOpen(lane);
                }
                else if (open.Members.Count == 1)
                {
                    arm = open;
                }
            }
        }

        if (follow is not null)
        {
            await WaitForOutcomeAsync(follow, key).ConfigureAwait(false);
            return await alone().ConfigureAwait(false);
        }

        if (start is not null)
        {
            Start(lane, start);
        }
        else if (arm is not null)
        {
            _ = CloseAfterWaitAsync(lane, arm);
        }

        return await member.RunAsync(consume, alone, cancellationToken).ConfigureAwait(false);
    }

    // Under the lane's lock.
    private static Batch TakeOpen(Lane lane)
    {
        Batch batch = lane.Open!;
        lane.Open = null;
        lane.Running++;
        return batch;
    }

    private async Task WaitForOutcomeAsync(Batch batch, InboxKey key)
    {
        try
        {
            await batch.Completed.Task.WaitAsync(_options.ClaimTimeout, _timeProvider).ConfigureAwait(false);
        }
        catch (TimeoutException exception)
        {
            throw new InboxClaimTimeoutException(
                $"Another delivery of message {key.MessageId} for consumer '{key.ConsumerName}' was still in its batch after {_options.ClaimTimeout}.", exception);
        }
    }

    private async Task CloseAfterWaitAsync(Lane lane, Batch batch)
    {
        await Task.Delay(_options.Batching.MaxWait, _timeProvider).ConfigureAwait(false);
        lock (lane)
        {
            if (!ReferenceEquals(lane.Open, batch))
            {
                return; // filled up, or started by a finishing batch, already
            }

            TakeOpen(lane);
        }

        Start(lane, batch);
    }

    private void Start(Lane lane, Batch batch)
    {
        // The leader must not inherit the first member's async locals (its activity, EF Core's execution strategy state).
        using (ExecutionContext.SuppressFlow())
        {
            _ = Task.Run(async () =>
            {
                Batch? next = null;
                try
                {
                    await RunAsync(batch).ConfigureAwait(false);
                }
                finally
                {
                    lock (lane)
                    {
                        lane.Running--;
                        if (lane.Open is { Members.Count: > 0 })
                        {
                            next = TakeOpen(lane);
                        }
                    }
                }

                if (next is not null)
                {
                    Start(lane, next);
                }
            });
        }
    }

    private async Task RunAsync(Batch batch)
    {
        var pending = new List<Member>(batch.Members);
        _telemetry.RecordBatchSize(batch.Members[0].Key.ConsumerName, pending.Count);
        IInboxBatch? unit = null;
        try
        {
            unit = await pending[0].Store.CreateBatchAsync().ConfigureAwait(false);
            IInboxBatch current = unit;
            await unit.ExecuteAsync(ct => AttemptAsync(current, pending, ct)).ConfigureAwait(false);
        }
        catch (InboxClaimTimeoutException exception) when (pending.Count > 1)
        {
            Log.BatchFallback(_logger, exception, pending.Count, pending[0].Key.ConsumerName);
            foreach (Member member in pending)
            {
                member.Post(Command.Alone);
            }
        }
        catch (Exception exception)
        {
            foreach (Member member in pending)
            {
                member.Post(Command.Finish(InboxOutcome.Failed, exception));
            }
        }
        finally
        {
            if (unit is not null)
            {
                try
                {
                    await unit.DisposeAsync().ConfigureAwait(false);
                }
                catch (Exception)
                {
                    // Every member has its answer already; the connection is returned or gone either way.
                }
            }

            batch.Completed.TrySetResult();
        }
    }

    private async Task<bool> AttemptAsync(IInboxBatch unit, List<Member> pending, CancellationToken cancellationToken)
    {
        await unit.BeginAsync(cancellationToken).ConfigureAwait(false);
        bool committed = false;
        try
        {
            long claimStarted = _timeProvider.GetTimestamp();
            IReadOnlySet<InboxKey> claimed = await unit.ClaimAsync(
                pending.Select(m => m.Key).ToList(), pending.Select(m => m.ReceivedAt).ToList(), _timeProvider.GetUtcNow().UtcDateTime,
                _options.ClaimTimeout, cancellationToken).ConfigureAwait(false);
            TimeSpan claimWait = _timeProvider.GetElapsedTime(claimStarted);
            var turns = new List<Member>(pending.Count);
            foreach (Member member in pending.ToList())
            {
                _telemetry.RecordClaimWait(member.Key.ConsumerName, claimWait);
                if (claimed.Contains(member.Key))
                {
                    turns.Add(member);
                    continue;
                }

                // Nothing was inserted: the insert waited for any other holder, so this is a committed claim.
                pending.Remove(member);
                Log.DuplicateDiscarded(_logger, member.Key.MessageId, member.Key.ConsumerName);
                member.Post(Command.Finish(InboxOutcome.Duplicate, null));
            }

            var succeeded = new List<Member>(turns.Count);
            for (int i = 0; i < turns.Count; i++)
            {
                Member member = turns[i];
                await unit.SavepointAsync(i, cancellationToken).ConfigureAwait(false);
                var done = new TaskCompletionSource<Exception?>(TaskCreationOptions.RunContinuationsAsynchronously);
                member.Post(Command.Turn(unit, done));
                Exception? error = await done.Task.ConfigureAwait(false);
                if (error is null)
                {
                    succeeded.Add(member);
                    continue;
                }

                // Its effects and its claim vanish before it is told, so its retry can claim the key again.
                await unit.RollbackMemberAsync(i, member.Key, cancellationToken).ConfigureAwait(false);
                pending.Remove(member);
                member.Post(Command.Finish(InboxOutcome.Failed, error));
            }

            if (succeeded.Count == 0)
            {
                return true;
            }

            await unit.CompleteAsync(cancellationToken).ConfigureAwait(false);
            committed = true;
            foreach (Member member in succeeded)
            {
                pending.Remove(member);
                Log.Processed(_logger, member.Key.MessageId, member.Key.ConsumerName);
                member.Post(Command.Finish(InboxOutcome.Processed, null));
            }

            return true;
        }
        finally
        {
            if (!committed)
            {
                await unit.RollbackAsync().ConfigureAwait(false);
            }
        }
    }

    private sealed class Lane
    {
        public Batch? Open;
        public int Running;
    }

    private sealed class Batch
    {
        public readonly List<Member> Members = [];
        public readonly HashSet<InboxKey> Keys = [];
        public readonly TaskCompletionSource Completed = new(TaskCreationOptions.RunContinuationsAsynchronously);
    }

    private sealed record Command(InboxOutcome Outcome, Exception? Error, IInboxBatch? Unit, TaskCompletionSource<Exception?>? Done, bool RunAlone)
    {
        public static readonly Command Alone = new(InboxOutcome.Failed, null, null, null, RunAlone: true);

        public static Command Finish(InboxOutcome outcome, Exception? error) => new(outcome, error, null, null, RunAlone: false);

        public static Command Turn(IInboxBatch unit, TaskCompletionSource<Exception?> done) => new(InboxOutcome.Failed, null, unit, done, RunAlone: false);
    }

    /// <summary>One delivery in a batch. Its consumer runs on the delivery's own async flow, when the leader gives it the turn.</summary>
    private sealed class Member(IInboxBatchStore store, InboxKey key, DateTime receivedAt)
    {
        private readonly Channel<Command> _commands = Channel.CreateUnbounded<Command>(new UnboundedChannelOptions { SingleReader = true, SingleWriter = true });

        public IInboxBatchStore Store { get; } = store;

        public InboxKey Key { get; } = key;

        public DateTime ReceivedAt { get; } = receivedAt;

        public void Post(Command command) => _commands.Writer.TryWrite(command);

        public async Task<InboxOutcome> RunAsync(Func<CancellationToken, Task> consume, Func<Task<InboxOutcome>> alone, CancellationToken cancellationToken)
        {
            while (true)
            {
                // Not cancellable: once in a batch, the leader decides; leaving early would strand its turn.
                Command command = await _commands.Reader.ReadAsync(CancellationToken.None).ConfigureAwait(false);
                if (command.Done is { } done)
                {
                    done.SetResult(await TakeTurnAsync(command.Unit!, consume, cancellationToken).ConfigureAwait(false));
                    continue;
                }

                await Store.LeaveBatchAsync().ConfigureAwait(false);
                if (command.RunAlone)
                {
                    return await alone().ConfigureAwait(false);
                }

                if (command.Error is { } error)
                {
                    ExceptionDispatchInfo.Throw(error);
                }

                return command.Outcome;
            }
        }

        private async Task<Exception?> TakeTurnAsync(IInboxBatch unit, Func<CancellationToken, Task> consume, CancellationToken cancellationToken)
        {
            try
            {
                // A retried batch attempt has a new transaction: leave the old one before the execution strategy looks.
                await Store.LeaveBatchAsync().ConfigureAwait(false);
                // The store's policy wraps the turn so that the consumer's own SaveChanges runs as part of it (EF Core
                // refuses a retrying strategy inside a transaction otherwise); the turn never throws, so it never retries.
                return await Store.ExecuteAsync<Exception?>(async ct =>
                {
                    try
                    {
                        await Store.JoinBatchAsync(unit, ct).ConfigureAwait(false);
                        await consume(ct).ConfigureAwait(false);
                        await Store.SaveBatchMemberAsync(ct).ConfigureAwait(false);
                        return null;
                    }
                    catch (Exception exception)
                    {
                        return exception;
                    }
                }, cancellationToken).ConfigureAwait(false);
            }
            catch (Exception exception)
            {
                return exception;
            }
        }
    }
}
