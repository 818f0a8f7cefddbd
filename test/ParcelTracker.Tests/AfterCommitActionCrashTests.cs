using ExactlyOnce;
using ExactlyOnce.Steps;
using ParcelTracker.Consumers;
using Xunit;
using Xunit.Abstractions;

namespace ParcelTracker.Tests;

/// <summary>
/// The SMS is an after-commit action. The process running the consumers and the dispatcher is killed with SIGKILL
/// 20 times — after the SMS was scheduled but before the commit, or after the gateway received the SMS but before the
/// action was marked done — and restarted; then the SMS the gateway received are counted.
/// </summary>
public sealed class AfterCommitActionCrashTests(ITestOutputHelper output) : ParcelTrackerDatabaseTest
{
    private const int Parcels = 20;
    private const string Notification = "parcel-tracker.notification";

    [Fact]
    public async Task Sms_KilledAfterSchedulingBeforeTheCommit_TwentyTimes_OnlyCommittedSchedulesAreSent_OncePerParcel()
    {
        // A gateway that ignores keys: any execution of a rolled-back schedule would show as a second SMS. The dispatcher
        // runs in a process of its own that is never killed: a kill landing between its gateway call and its done-mark
        // would repeat a committed action (at least once, the other test's subject), not execute a rolled-back one.
        await using var rig = await CrashRig.StartAsync(Database,
            ["consumer", "--crash-at", "after-schedule", "--crash-times", "20"], output,
            companion: ["worker", "--sms-honours-keys", "false"]);
        var parcels = await rig.SendParcelsAsync(Parcels, NotificationConsumer.Queue);
        await RunUntilSentAsync(rig, "after-schedule", NotificationConsumer.Queue);

        output.WriteLine(await DescribeAsync(rig, "after-schedule", NotificationConsumer.Queue));
        Assert.All(rig.ExitCodes, code => Assert.Equal(137, code));
        Assert.Equal(Parcels, await rig.ScalarAsync("SELECT count(*) FROM notifications_sent"));
        Assert.Equal(Parcels, await rig.ScalarAsync("SELECT count(DISTINCT parcel_id) FROM notifications_sent"));
        await AssertKeysAreDerivedAsync(rig, parcels);
    }

    [Theory]
    [InlineData(false)]
    [InlineData(true)]
    public async Task Sms_DispatcherKilledAfterTheGatewayCall_TwentyTimes_IsRepeatedWithTheSameKey_SentOnceWhenTheGatewayHonoursIt(bool gatewayHonoursKeys)
    {
        await using var rig = await CrashRig.StartAsync(Database,
            ["consumer,worker", "--sms-honours-keys", gatewayHonoursKeys ? "true" : "false", "--crash-at", "after-action-call", "--crash-times", "20"], output);
        var parcels = await rig.SendParcelsAsync(Parcels, NotificationConsumer.Queue);
        await RunUntilSentAsync(rig, "after-action-call", SendParcelSms.Name);

        output.WriteLine(await DescribeAsync(rig, "after-action-call", SendParcelSms.Name));
        Assert.All(rig.ExitCodes, code => Assert.Equal(137, code));
        long calls = await rig.ScalarAsync("SELECT sum(calls) FROM notifications_sent");
        Assert.True(calls >= 2 * Parcels, $"each of the 20 crashed executions was repeated: {calls} calls");
        Assert.Equal(1, await rig.ScalarAsync("SELECT max(n) FROM (SELECT count(DISTINCT idempotency_key) n FROM notifications_sent GROUP BY parcel_id) k"));
        await AssertKeysAreDerivedAsync(rig, parcels);
        if (gatewayHonoursKeys)
        {
            Assert.Equal(Parcels, await rig.ScalarAsync("SELECT count(*) FROM notifications_sent")); // exactly one SMS per parcel
        }
        else
        {
            // At least once: every parcel's crashed execution was repeated. Not "exactly twice": a kill gathered for one
            // parcel's crash can land between another parcel's repeated call and its done-mark, which sends a third.
            long fewest = await rig.ScalarAsync("SELECT min(n) FROM (SELECT count(*) n FROM notifications_sent GROUP BY parcel_id) s");
            Assert.True(fewest >= 2, $"every parcel's crashed SMS was sent again: the fewest sent for a parcel is {fewest}");
        }
    }

    private static async Task RunUntilSentAsync(CrashRig rig, string point, string who) =>
        await rig.RunUntilAsync(async () =>
            rig.CrashesAt(point, who) == Parcels
            && await rig.ScalarAsync($"SELECT count(*) FROM inbox_messages WHERE consumer_type = '{Notification}' AND processed_at IS NOT NULL") == Parcels
            && await rig.ScalarAsync("SELECT count(*) FROM outbox_messages WHERE dispatched_at IS NULL") == 0
            && await rig.ScalarAsync("SELECT count(DISTINCT parcel_id) FROM notifications_sent") == Parcels,
            "every SMS sent after 20 crashes", TimeSpan.FromMinutes(3));

    private static async Task AssertKeysAreDerivedAsync(CrashRig rig, List<(Guid ParcelId, Guid MessageId)> parcels)
    {
        foreach (var (parcelId, messageId) in parcels)
        {
            Guid key = IdempotencyKeys.ForAction(new InboxKey(messageId, Notification), SendParcelSms.Name, 1);
            Assert.Equal(
                await rig.ScalarAsync($"SELECT count(*) FROM notifications_sent WHERE parcel_id = '{parcelId}'"),
                await rig.ScalarAsync($"SELECT count(*) FROM notifications_sent WHERE parcel_id = '{parcelId}' AND idempotency_key = '{key}'"));
        }
    }

    private static async Task<string> DescribeAsync(CrashRig rig, string point, string who) =>
        $"{point}: {rig.CrashesAt(point, who)} crashes at the point, {rig.ExitCodes.Count} kills (exit codes {string.Join(",", rig.ExitCodes.Distinct())}); " +
        $"SMS rows {await rig.ScalarAsync("SELECT count(*) FROM notifications_sent")}, gateway calls {await rig.ScalarAsync("SELECT sum(calls) FROM notifications_sent")}, " +
        $"parcels notified {await rig.ScalarAsync("SELECT count(DISTINCT parcel_id) FROM notifications_sent")}";
}
