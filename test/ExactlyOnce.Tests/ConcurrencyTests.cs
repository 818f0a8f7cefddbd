using System.Collections.Concurrent;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Diagnostics.Metrics.Testing;
using Npgsql;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>Concurrent deliveries of one message id, for real: two bus instances, one queue, real PostgreSQL locks.</summary>
public class ConcurrencyTests : PostgresRabbitTest
{
    /// <summary>
    /// Trap 2 (check-then-insert race). A design that checks for the row and inserts it after running the consumer
    /// lets several of these concurrent first arrivals find no row and all enter the consumer; here each round must
    /// enter the body exactly once.
    /// </summary>
    [Fact]
    public async Task Consume_SixteenConcurrentFirstArrivalsOnTwoBuses_ConsumerBodyEnteredOncePerRound_FiftyRounds()
    {
        const int rounds = 50;
        const int copies = 16;
        string queue = Queue("race");
        var counterA = new DeliveryCounter();
        var counterB = new DeliveryCounter();
        var overlap = new OverlapFilter();
        Probe.HoldAfterEntering = TimeSpan.FromMilliseconds(20); // keep the claim open while the others arrive
        var busA = await StartConsumerHostAsync<EffectConsumer>(queue, counterA, e => e.UseFilter(overlap));
        var busB = await StartConsumerHostAsync<EffectConsumer>(queue, counterB, e => e.UseFilter(overlap));

        var ids = new List<Guid>();
        for (int round = 1; round <= rounds; round++)
        {
            var id = NewId.NextGuid();
            ids.Add(id);
            await SendAsync(round % 2 == 0 ? busA : busB, queue, id, copies);
            int expected = round * copies;
            await Eventually.AssertAsync(() => Task.FromResult(counterA.Handled + counterB.Handled >= expected), $"round {round} handled");
            Assert.Equal(1, Probe.Entries(id, nameof(EffectConsumer)));
        }

        Assert.Equal(rounds, Probe.TotalEntries);
        Assert.Equal(0, counterA.Faulted + counterB.Faulted);
        Assert.True(counterA.Handled > 0 && counterB.Handled > 0, $"both buses must take part (A {counterA.Handled}, B {counterB.Handled})");
        // The deliveries really were concurrent: many copies of one id were inside the pipeline at the same time.
        Assert.True(overlap.MaxOverlap >= 4, $"copies of one id overlapped at most {overlap.MaxOverlap} at a time");
        await using var db = NewContext();
        var effects = await db.Effects.GroupBy(e => e.MessageId).Select(g => g.Count()).ToListAsync();
        Assert.Equal(rounds, effects.Count);
        Assert.All(effects, n => Assert.Equal(1, n));
    }

    /// <summary>
    /// Trap 5 (dropping a duplicate too early). A design that marks the id as seen before the consumer commits would
    /// drop the second copy while the first is still in flight, and lose the message when the first then fails.
    /// </summary>
    [Fact]
    public async Task Consume_FirstDeliveryInFlightThenRolledBack_SecondDeliveryWaitsAndIsProcessed()
    {
        string queue = Queue("inflight");
        var counter = new DeliveryCounter();
        var (firstEntered, releaseFirst) = HoldThenFailFirstDelivery();
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter);
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await firstEntered.Task.WaitAsync(TimeSpan.FromSeconds(30));
        await SendAsync(host, queue, id);
        // The second copy is blocked inside PostgreSQL on the first one's uncommitted claim.
        await Eventually.AssertAsync(async () => await BackendsWaitingOnLocksAsync() >= 1, "second delivery waits on the claim");
        Assert.Equal(1, Probe.Entries(id, nameof(EffectConsumer)));

        releaseFirst.SetResult();
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 2), "both deliveries handled");

        Assert.Equal(2, Probe.Entries(id, nameof(EffectConsumer)));
        Assert.Equal(1, await CountEffectsAsync(id));
        Assert.NotNull(Assert.Single(await InboxRowsAsync(id)).ProcessedAt);
        Assert.Equal(1u, await RabbitAdmin.CountAsync(queue + "_error")); // the failed first attempt, recoverable
    }

    [Fact]
    public async Task Consume_ClaimHeldLongerThanClaimTimeout_DeliveryIsRetriedLaterNeverDiscarded()
    {
        string queue = Queue("timeout");
        var counter = new DeliveryCounter();
        var (firstEntered, releaseFirst) = HoldThenFailFirstDelivery();
        var host = await StartConsumerHostAsync<EffectConsumer>(queue, counter, options: o => o.ClaimTimeout = TimeSpan.FromMilliseconds(300));
        using var deferred = new MetricCollector<long>(host.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>(),
            "ExactlyOnce", "exactlyonce.inbox.messages.deferred");
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await firstEntered.Task.WaitAsync(TimeSpan.FromSeconds(30));
        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(deferred.GetMeasurementSnapshot().Count >= 2), "the waiting copy timed out and was re-queued (twice)");
        Assert.Equal(1, Probe.Entries(id, nameof(EffectConsumer)));
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_error"));

        releaseFirst.SetResult();
        await Eventually.AssertAsync(async () => await CountEffectsAsync(id) == 1, "the re-queued copy processed");
        Assert.Equal(2, Probe.Entries(id, nameof(EffectConsumer)));
        Assert.NotNull(Assert.Single(await InboxRowsAsync(id)).ProcessedAt);
        await Eventually.AssertAsync(async () => await RabbitAdmin.CountAsync(queue) == 0, "queue drained");
        // Only the failed claim holder; its move to the error queue may finish after the copy committed.
        await Eventually.AssertAsync(() => Task.FromResult(counter.Handled >= 2 + (int)deferred.GetMeasurementSnapshot().EvaluateAsCounter()), "every delivery left the pipe");
        Assert.Equal(1u, await RabbitAdmin.CountAsync(queue + "_error"));
    }

    /// <summary>
    /// The first delivery of a message enters the consumer, signals, holds its uncommitted claim until released, then
    /// fails and rolls back.
    /// </summary>
    private (TaskCompletionSource Entered, TaskCompletionSource Release) HoldThenFailFirstDelivery()
    {
        var entered = new TaskCompletionSource(TaskCreationOptions.RunContinuationsAsynchronously);
        var release = new TaskCompletionSource(TaskCreationOptions.RunContinuationsAsynchronously);
        Probe.BeforeSave = async (context, _) =>
        {
            if (Probe.Entries(context.MessageId!.Value, nameof(EffectConsumer)) == 1)
            {
                entered.SetResult();
                await release.Task;
                throw new InvalidOperationException("the first delivery fails after holding its claim");
            }
        };
        return (entered, release);
    }

    private async Task<long> BackendsWaitingOnLocksAsync()
    {
        await using var connection = new NpgsqlConnection(ConnectionString);
        await connection.OpenAsync();
        await using var command = new NpgsqlCommand(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = @db AND wait_event_type = 'Lock'", connection);
        command.Parameters.AddWithValue("db", DatabaseName);
        return (long)(await command.ExecuteScalarAsync())!;
    }

    /// <summary>Measures how many deliveries of the same message id are inside the consume pipeline at once.</summary>
    private sealed class OverlapFilter : IFilter<ConsumeContext>
    {
        private readonly ConcurrentDictionary<Guid, int> _inFlight = new();
        private int _maxOverlap;

        public int MaxOverlap => Volatile.Read(ref _maxOverlap);

        public async Task Send(ConsumeContext context, IPipe<ConsumeContext> next)
        {
            Guid id = context.MessageId ?? Guid.Empty;
            int now = _inFlight.AddOrUpdate(id, 1, (_, n) => n + 1);
            int seen;
            while (now > (seen = Volatile.Read(ref _maxOverlap)) && Interlocked.CompareExchange(ref _maxOverlap, now, seen) != seen)
            {
            }

            try
            {
                await next.Send(context);
            }
            finally
            {
                _inFlight.AddOrUpdate(id, 0, (_, n) => n - 1);
            }
        }

        public void Probe(ProbeContext context) => context.CreateFilterScope("overlap");
    }
}
