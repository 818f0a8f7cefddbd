using System.Collections.Concurrent;
using ExactlyOnce.Actions;
using ExactlyOnce.EntityFrameworkCore;
using ExactlyOnce.Maintenance;
using ExactlyOnce.Steps;
using ExactlyOnce.Tests.Infrastructure;
using ExactlyOnce.TestHost;
using MassTransit;
using Microsoft.EntityFrameworkCore;
using Microsoft.Extensions.DependencyInjection;
using Microsoft.Extensions.Diagnostics.Metrics.Testing;
using Microsoft.Extensions.Hosting;
using Microsoft.Extensions.Time.Testing;
using Xunit;

namespace ExactlyOnce.Tests;

/// <summary>What a test scripts for <see cref="StepConsumer"/> and observes of its external call.</summary>
public sealed class StepScript
{
    private int _calls;
    private int _attempts;

    public ConcurrentQueue<Guid> KeysCalled { get; } = new();

    public ConcurrentQueue<string> Results { get; } = new();

    public int Calls => Volatile.Read(ref _calls);

    public int Attempts => Volatile.Read(ref _attempts);

    public StepPolicy Policy { get; set; } = StepPolicy.RetryWithSameKey;

    /// <summary>What the n-th call (1-based) does after the remote service "acted": return normally, or throw this.</summary>
    public Func<int, Exception?> CallFailure { get; set; } = _ => null;

    /// <summary>The consumer throws after the step on these attempts (1-based): the transaction rolls back.</summary>
    public HashSet<int> FailAfterStepOnAttempts { get; } = [];

    public int NextAttempt() => Interlocked.Increment(ref _attempts);

    public Task<string> CallAsync(Guid key)
    {
        int call = Interlocked.Increment(ref _calls);
        KeysCalled.Enqueue(key);
        if (CallFailure(call) is { } failure)
        {
            throw failure;
        }

        return Task.FromResult($"booking-{call}");
    }
}

/// <summary>A consumer whose external call is a recorded step, followed by its own database write.</summary>
public sealed class StepConsumer(TestDbContext db, IRecordedSteps steps, StepScript script) : IConsumer<TestMessage>
{
    public async Task Consume(ConsumeContext<TestMessage> context)
    {
        int attempt = script.NextAttempt();
        string result = await steps.RunAsync("book", (key, _) => script.CallAsync(key), script.Policy, context.CancellationToken);
        script.Results.Enqueue(result);
        db.Effects.Add(new Effect { MessageId = context.MessageId!.Value, Consumer = "step:" + result });
        if (script.FailAfterStepOnAttempts.Contains(attempt))
        {
            throw new InvalidOperationException($"failing attempt {attempt} after the step");
        }
    }
}

/// <summary>A consumer that schedules an after-commit action and may fail afterwards (rolling the schedule back).</summary>
public sealed class SchedulingConsumer(TestDbContext db, IAfterCommitActions actions, StepScript script) : IConsumer<TestMessage>
{
    public Task Consume(ConsumeContext<TestMessage> context)
    {
        int attempt = script.NextAttempt();
        actions.Schedule(ActionProbe.Name, new ActionPayload(context.MessageId!.Value, attempt));
        db.Effects.Add(new Effect { MessageId = context.MessageId!.Value, Consumer = "scheduler" });
        return script.FailAfterStepOnAttempts.Contains(attempt)
            ? throw new InvalidOperationException($"failing attempt {attempt} after scheduling")
            : Task.CompletedTask;
    }
}

public sealed record ActionPayload(Guid MessageId, int ScheduledByAttempt);

/// <summary>The after-commit action's handler: records every execution; can be told to fail the first ones.</summary>
public sealed class ActionProbe : IAfterCommitAction<ActionPayload>
{
    public const string Name = "notify-test";

    public static ConcurrentQueue<(ActionPayload Payload, AfterCommitActionContext Context)> Executions { get; } = new();

    public static int FailFirst { get; set; }

    public Task ExecuteAsync(ActionPayload payload, AfterCommitActionContext context, CancellationToken cancellationToken)
    {
        Executions.Enqueue((payload, context));
        return Executions.Count <= FailFirst ? throw new TimeoutException($"gateway timeout on execution {Executions.Count}") : Task.CompletedTask;
    }
}

/// <summary>Recorded steps and after-commit actions through MassTransit, against real PostgreSQL and RabbitMQ.</summary>
[Collection(nameof(ActionProbe))]
public sealed class RecordedStepTests : PostgresRabbitTest
{
    private static readonly string StepConsumerName = typeof(StepConsumer).FullName!;
    private readonly StepScript _script = new();

    [Fact]
    public async Task Step_ConsumerFailsAfterTheStepCompleted_TheRetryGetsTheRecordedResult_TheCallIsMadeOnce()
    {
        _script.FailAfterStepOnAttempts.Add(1);
        var (host, queue) = await StartStepHostAsync();
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(async () => await CountEffectsAsync(id) == 1, "the retry committed");

        Assert.Equal(2, _script.Attempts);
        Assert.Equal(1, _script.Calls);
        Assert.Equal(["booking-1", "booking-1"], _script.Results); // the second attempt got the first call's result
        Assert.Equal(IdempotencyKeys.ForStep(new InboxKey(id, StepConsumerName), "book"), Assert.Single(_script.KeysCalled));
        var record = await StepAsync(host, id);
        Assert.Equal(StepStatus.Completed, record!.Status);
        Assert.Equal("\"booking-1\"", record.Result);
        Assert.Equal(1, record.Attempts);
    }

    [Fact]
    public async Task Step_CallFailsWithUnknownOutcome_RetryWithSameKey_CallsAgainWithTheSameKey()
    {
        _script.CallFailure = call => call == 1 ? new TimeoutException("the carrier did not answer in time") : null;
        var (host, queue) = await StartStepHostAsync();
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(async () => await CountEffectsAsync(id) == 1, "the retry committed");

        Assert.Equal(2, _script.Calls);
        Assert.Single(_script.KeysCalled.Distinct());
        var record = await StepAsync(host, id);
        Assert.Equal(StepStatus.Completed, record!.Status);
        Assert.Equal(2, record.Attempts);
    }

    [Fact]
    public async Task Step_CallSaysNotPerformed_TheNextAttemptCalls_EvenUnderThePark_Policy()
    {
        _script.Policy = StepPolicy.Park;
        _script.CallFailure = call => call == 1 ? new StepNotPerformedException("rejected with 400 before booking") : null;
        var (host, queue) = await StartStepHostAsync();
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(async () => await CountEffectsAsync(id) == 1, "the retry committed");

        Assert.Equal(2, _script.Calls);
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_parked"));
        Assert.Equal(StepStatus.Completed, (await StepAsync(host, id))!.Status);
    }

    [Fact]
    public async Task Step_Reconcile_FoundDone_IsRecordedWithoutCalling_FoundNotDone_CallsWithTheSameKey()
    {
        var found = new ConcurrentDictionary<Guid, bool>();
        _script.CallFailure = call => call <= 2 ? new TimeoutException("no answer") : null;
        _script.Policy = StepPolicy.Reconcile<string>((key, _) => Task.FromResult(found.TryGetValue(key, out bool done) && done
            ? Reconciliation.Done("found-at-carrier")
            : Reconciliation.NotDone<string>()));
        var (host, queue) = await StartStepHostAsync();
        var done = NewId.NextGuid();
        found[IdempotencyKeys.ForStep(new InboxKey(done, StepConsumerName), "book")] = true;

        await SendAsync(host, queue, done);
        await Eventually.AssertAsync(async () => await CountEffectsAsync(done, "step:found-at-carrier") == 1, "reconciled as done");
        Assert.Equal(1, _script.Calls); // only the first, failed call

        var notDone = NewId.NextGuid();
        await SendAsync(host, queue, notDone);
        await Eventually.AssertAsync(async () => await CountEffectsAsync(notDone) == 1, "called again after reconciliation");
        Assert.Equal(3, _script.Calls);
        Assert.Single(_script.KeysCalled.Skip(1).Distinct()); // both calls of the second message carry its key
        Assert.Equal(StepStatus.Completed, (await StepAsync(host, notDone))!.Status);
    }

    [Fact]
    public async Task Step_UnknownOutcomeUnderPark_MessageIsParkedWithItsReason_ResolvedAndRedriven_ItCompletesWithoutCallingAgain()
    {
        _script.Policy = StepPolicy.Park;
        _script.CallFailure = call => call == 1 ? new TimeoutException("the carrier did not answer in time") : null;
        var (host, queue) = await StartStepHostAsync();
        using var parkedCounter = new MetricCollector<long>(host.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>(),
            "ExactlyOnce", "exactlyonce.inbox.messages.parked");
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(async () => await RabbitAdmin.CountAsync(queue + "_parked") == 1, "parked");

        // Not lost: in the parked queue with its reason; listed for the operator; nothing committed; counted.
        Assert.Equal(0, await CountEffectsAsync(id));
        Assert.Equal(1, _script.Calls);
        var admin = host.Services.GetRequiredService<IRecordedStepAdministration>();
        var parked = Assert.Single(await admin.ListParkedAsync());
        Assert.Equal(new StepKey(new InboxKey(id, StepConsumerName), "book"), parked.Key);
        Assert.Contains("unknown", parked.Reason, StringComparison.Ordinal);
        Assert.Contains("did not answer in time", parked.Reason, StringComparison.Ordinal); // the last error is kept
        Assert.Equal(1, Assert.Single(parkedCounter.GetMeasurementSnapshot()).Value);
        Assert.Equal(0u, await RabbitAdmin.CountAsync(queue + "_error"));

        // Redriven without a resolution, it parks again and calls nothing.
        Assert.True(await RabbitAdmin.MoveAsync(queue + "_parked", queue));
        await Eventually.AssertAsync(async () => await RabbitAdmin.CountAsync(queue + "_parked") == 1, "parked again");
        Assert.Equal(1, _script.Calls);

        // The operator checked with the carrier: it did book. Resolve, redrive: completes with that result, no call.
        await admin.ResolveAsync(parked.Key, "\"booking-confirmed-by-phone\"");
        var copy = await RabbitAdmin.GetAsync(queue + "_parked");
        Assert.Contains("unknown", copy!.Value.Headers["ExactlyOnce-Parked-Reason"], StringComparison.Ordinal);
        Assert.Equal(id.ToString(), copy.Value.MessageId);
        await SendAsync(host, queue, id); // the re-driven copy (same message id)
        await Eventually.AssertAsync(async () => await CountEffectsAsync(id, "step:booking-confirmed-by-phone") == 1, "completed after resolution");
        Assert.Equal(1, _script.Calls);
        Assert.Empty(await admin.ListParkedAsync());
    }

    [Fact]
    public async Task Step_OutsideAConsumerUnderTheInbox_FailsWithAClearError()
    {
        var (host, _) = await StartStepHostAsync();
        await using var scope = host.Services.CreateAsyncScope();
        var steps = scope.ServiceProvider.GetRequiredService<IRecordedSteps>();

        var error = await Assert.ThrowsAsync<InvalidOperationException>(() => steps.RunAsync("book", (_, _) => Task.FromResult(1), StepPolicy.Park));
        Assert.Contains("outside a consumer under the inbox", error.Message, StringComparison.Ordinal);
    }

    [Fact]
    public async Task Step_JournalInTheInboxsOwnSqliteFile_FailsWithAnErrorThatNamesTheFix()
    {
        string file = Path.Combine(Path.GetTempPath(), $"eo-steps-{Guid.NewGuid():N}.db");
        var services = new ServiceCollection();
        services.AddLogging();
        services.AddDbContext<TestDbContext>(o => o.UseSqlite("Data Source=" + file));
        services.AddExactlyOnce<TestDbContext>();
        await using var provider = services.BuildServiceProvider();
        try
        {
            var error = await Assert.ThrowsAsync<InvalidOperationException>(() =>
                provider.GetRequiredService<IStepStore>().FindAsync(new StepKey(new InboxKey(Guid.NewGuid(), "c"), "s")));
            Assert.Contains("AddExactlyOnceRecordedSteps<TStepsDbContext>()", error.Message, StringComparison.Ordinal);
        }
        finally
        {
            Microsoft.Data.Sqlite.SqliteConnection.ClearAllPools();
            File.Delete(file);
        }
    }

    [Fact]
    public void IdempotencyKeys_AreStablePerMessageConsumerAndName_AndDistinctOtherwise()
    {
        var message = new InboxKey(Guid.Parse("0f8fad5b-d9cb-469f-a165-70867728950e"), "billing");
        Guid key = IdempotencyKeys.ForStep(message, "charge");

        Assert.Equal(key, IdempotencyKeys.ForStep(message with { }, "charge"));
        Assert.Equal(8, key.Version);
        Assert.NotEqual(key, IdempotencyKeys.ForStep(message, "refund"));
        Assert.NotEqual(key, IdempotencyKeys.ForStep(message with { ConsumerName = "shipping" }, "charge"));
        Assert.NotEqual(key, IdempotencyKeys.ForStep(message with { MessageId = Guid.NewGuid() }, "charge"));
        Assert.NotEqual(key, IdempotencyKeys.ForAction(message, "charge", 1));
        Assert.NotEqual(IdempotencyKeys.ForAction(message, "sms", 1), IdempotencyKeys.ForAction(message, "sms", 2));
    }

    [Fact]
    public async Task Cleanup_DeletesSettledStepsOlderThanTheInboxRetention_KeepsStartedAndParkedOnes()
    {
        var clock = new FakeTimeProvider(new DateTimeOffset(2026, 11, 1, 0, 0, 0, TimeSpan.Zero));
        var host = await StartHostAsync(new TestHosts.Options
        {
            Database = o => o.UseNpgsql(ConnectionString),
            Services = s => s.AddSingleton<TimeProvider>(clock).AddExactlyOnceMaintenance(),
            InboxOnAllEndpoints = false,
            Consumers = _ => { },
            Endpoints = (_, _) => { },
        });
        var store = host.Services.GetRequiredService<IStepStore>();
        DateTime old = clock.GetUtcNow().UtcDateTime.AddDays(-8);
        DateTime recent = clock.GetUtcNow().UtcDateTime.AddDays(-1);
        async Task<StepKey> AddAsync(StepStatus status, DateTime at)
        {
            var key = new StepKey(new InboxKey(Guid.NewGuid(), "c"), "s");
            await store.StartAsync(key, Guid.NewGuid(), null, at);
            if (status == StepStatus.Completed)
            {
                await store.CompleteAsync(key, "1", at);
            }
            else if (status != StepStatus.Started)
            {
                await store.SetStatusAsync(key, status, "why", at);
            }

            return key;
        }

        var oldCompleted = await AddAsync(StepStatus.Completed, old);
        var oldNotDone = await AddAsync(StepStatus.NotDone, old);
        var oldStarted = await AddAsync(StepStatus.Started, old);
        var oldParked = await AddAsync(StepStatus.Parked, old);
        var recentCompleted = await AddAsync(StepStatus.Completed, recent);

        await host.Services.GetRequiredService<RetentionCleanupService>().RunOnceAsync();

        Assert.Null(await store.FindAsync(oldCompleted));
        Assert.Null(await store.FindAsync(oldNotDone));
        Assert.NotNull(await store.FindAsync(oldStarted)); // an unknown outcome's only trace
        Assert.NotNull(await store.FindAsync(oldParked));
        Assert.NotNull(await store.FindAsync(recentCompleted));
    }

    [Fact]
    public async Task AfterCommitAction_ScheduledThenRolledBack_NeverRuns_TheCommittedScheduleRunsOnceWithItsDerivedKey()
    {
        ActionProbe.Executions.Clear();
        ActionProbe.FailFirst = 0;
        _script.FailAfterStepOnAttempts.Add(1);
        var (host, queue) = await StartActionHostAsync<SchedulingConsumer>();
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(!ActionProbe.Executions.IsEmpty), "the action ran");
        await Task.Delay(500); // nothing else may follow

        var (payload, context) = Assert.Single(ActionProbe.Executions);
        Assert.Equal(2, payload.ScheduledByAttempt); // the rolled-back attempt's schedule never ran
        Assert.Equal(IdempotencyKeys.ForAction(new InboxKey(id, typeof(SchedulingConsumer).FullName!), ActionProbe.Name, 1), context.IdempotencyKey);
        Assert.Equal(1, context.Attempt);
        Assert.Equal(ActionProbe.Name, context.Name);
    }

    [Fact]
    public async Task AfterCommitAction_Failing_RecordsAttemptsAndLastError_AndRetriesWithTheSameKeyUntilItSucceeds()
    {
        ActionProbe.Executions.Clear();
        ActionProbe.FailFirst = 2;
        var (host, queue) = await StartActionHostAsync<SchedulingConsumer>(backoff: TimeSpan.FromSeconds(1));
        var meters = host.Services.GetRequiredService<System.Diagnostics.Metrics.IMeterFactory>();
        using var executed = new MetricCollector<long>(meters, "ExactlyOnce", "exactlyonce.actions.executed");
        using var failed = new MetricCollector<long>(meters, "ExactlyOnce", "exactlyonce.actions.failed");
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        // While it backs off, the row shows the attempts and the last error.
        await Eventually.AssertAsync(async () =>
        {
            await using var db = NewContext();
            return await db.Set<OutboxMessage>().AnyAsync(m => m.Attempts == 1 && m.LastError != null && m.LastError.Contains("gateway timeout on execution 1") && m.DispatchedAt == null);
        }, "the first failure recorded on the row");
        await Eventually.AssertAsync(() => Task.FromResult(ActionProbe.Executions.Count == 3), "three executions", TimeSpan.FromSeconds(30));

        Assert.Single(ActionProbe.Executions.Select(e => e.Context.IdempotencyKey).Distinct());
        Assert.Equal([1, 2, 3], ActionProbe.Executions.Select(e => e.Context.Attempt));
        await using var db = NewContext();
        await Eventually.AssertAsync(async () => await NewContext().Set<OutboxMessage>().AnyAsync(m => m.DispatchedAt != null), "marked done");
        var row = await db.Set<OutboxMessage>().AsNoTracking().SingleAsync();
        Assert.Equal("exactlyonce-action:" + ActionProbe.Name, row.Destination);
        Assert.Equal(3, row.Attempts); // two failures and the success
        Assert.Null(row.LastError);
        Assert.Equal(1, executed.GetMeasurementSnapshot().Sum(m => m.Value));
        Assert.Equal(2, failed.GetMeasurementSnapshot().Sum(m => m.Value));
    }

    [Fact]
    public async Task AfterCommitAction_AttemptRetriedByTheExecutionStrategyInTheSameScope_KeepsItsDerivedKey()
    {
        ActionProbe.Executions.Clear();
        ActionProbe.FailFirst = 0;
        var failCommit = new FailingCommitInterceptor { Remaining = 1, Exception = () => new Npgsql.NpgsqlException("injected transient failure", new TimeoutException()) };
        var (host, queue) = await StartActionHostAsync<SchedulingConsumer>(database: o => o
            .UseNpgsql(ConnectionString, n => n.EnableRetryOnFailure(3, TimeSpan.FromMilliseconds(50), null))
            .AddInterceptors(failCommit));
        var id = NewId.NextGuid();

        await SendAsync(host, queue, id);
        await Eventually.AssertAsync(() => Task.FromResult(!ActionProbe.Executions.IsEmpty), "the action ran");
        await Task.Delay(300);

        Assert.Equal(1, failCommit.Failed);
        Assert.Equal(2, _script.Attempts); // both attempts ran in one consume scope
        var (_, context) = Assert.Single(ActionProbe.Executions);
        Assert.Equal(IdempotencyKeys.ForAction(new InboxKey(id, typeof(SchedulingConsumer).FullName!), ActionProbe.Name, 1), context.IdempotencyKey);
    }

    [Fact]
    public async Task AfterCommitAction_FromAnApiScope_RunsOnlyAfterSaveChangesCommits()
    {
        ActionProbe.Executions.Clear();
        ActionProbe.FailFirst = 0;
        var (host, _) = await StartActionHostAsync<SchedulingConsumer>();
        var committed = Guid.NewGuid();
        var abandoned = Guid.NewGuid();

        await using (var scope = host.Services.CreateAsyncScope())
        {
            scope.ServiceProvider.GetRequiredService<IAfterCommitActions>().Schedule(ActionProbe.Name, new ActionPayload(abandoned, 0));
            // no SaveChanges: the unit of work is abandoned
        }

        Guid key;
        await using (var scope = host.Services.CreateAsyncScope())
        {
            key = scope.ServiceProvider.GetRequiredService<IAfterCommitActions>().Schedule(ActionProbe.Name, new ActionPayload(committed, 0));
            Assert.True(ActionProbe.Executions.IsEmpty); // not before the commit
            await scope.ServiceProvider.GetRequiredService<TestDbContext>().SaveChangesAsync();
        }

        await Eventually.AssertAsync(() => Task.FromResult(!ActionProbe.Executions.IsEmpty), "the committed action ran");
        await Task.Delay(300);
        var (payload, context) = Assert.Single(ActionProbe.Executions);
        Assert.Equal(committed, payload.MessageId);
        Assert.Equal(key, context.IdempotencyKey);
    }

    private async Task<(IHost Host, string Queue)> StartStepHostAsync()
    {
        string queue = Queue("steps");
        var host = await StartConsumerHostAsync<StepConsumer>(queue,
            endpoint: e => e.UseMessageRetry(r => r.Immediate(3)),
            services: s => s.AddSingleton(_script));
        return (host, queue);
    }

    private async Task<(IHost Host, string Queue)> StartActionHostAsync<TConsumer>(TimeSpan? backoff = null, Action<DbContextOptionsBuilder>? database = null)
        where TConsumer : class, IConsumer
    {
        string queue = Queue("actions");
        var host = await StartHostAsync(new TestHosts.Options
        {
            Database = database ?? (o => o.UseNpgsql(ConnectionString)),
            Services = s => s.AddSingleton(_script).AddSingleton(Probe)
                .AddExactlyOnceAfterCommitAction<ActionPayload, ActionProbe>(ActionProbe.Name),
            Dispatcher = true,
            ExactlyOnce = o =>
            {
                o.Outbox.InitialBackoff = backoff ?? TimeSpan.FromMilliseconds(100);
                o.Outbox.PollingInterval = TimeSpan.FromMilliseconds(200);
            },
            Consumers = x => x.AddConsumer<TConsumer>(),
            Endpoints = (context, cfg) => cfg.ReceiveEndpoint(queue, e =>
            {
                e.ConfigureConsumeTopology = false;
                e.UseMessageRetry(r => r.Immediate(3));
                e.ConfigureConsumer<TConsumer>(context);
            }),
        });
        return (host, queue);
    }

    private static async Task<StepRecord?> StepAsync(IHost host, Guid messageId) =>
        await host.Services.GetRequiredService<IStepStore>().FindAsync(new StepKey(new InboxKey(messageId, StepConsumerName), "book"));
}
